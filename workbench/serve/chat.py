"""OpenAI chat requests as token streams, and completions as OpenAI JSON.

`render_messages` turns `messages` (text and `image_url` content parts with PNG/JPEG data URLs)
into a `workbench.policy.Stream` with the same markup the rollouts build: a system message as
`start_stream` writes it, a user turn as `append_user` writes it (parts in the order given), an
assistant turn as its reply followed by `<|im_end|>`, and finally the open assistant header. So a
maze conversation sent turn by turn gets the tokens the policy was trained on.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.policy import ChatFormat, Completion, Stream, encode_image

IMAGE_TYPES = ("image/png", "image/jpeg", "image/jpg")
ROLES = ("system", "user", "assistant")


class RequestError(ValueError):
    """A request the server cannot take; `status` is the HTTP status, `code` OpenAI's code."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request",
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.kind = status, code, kind


@dataclass(frozen=True)
class ChatRequest:
    """The fields of /v1/chat/completions the engine uses."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    n: int = 1
    seed: int | None = None
    logprobs: bool = False


def parse_request(body: Any, default_max_tokens: int, max_tokens_limit: int) -> ChatRequest:
    """Validate a chat-completions body; RequestError (400) names the bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key in ("model", "messages"):
        if key not in body:
            raise RequestError(f"missing required field {key!r}")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by this server", code="unsupported")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_tokens_limit:
        raise RequestError(f"max_tokens must be an integer in [1, {max_tokens_limit}]")
    n = body.get("n") or 1
    if not isinstance(n, int) or not 1 <= n <= 16:
        raise RequestError("n must be an integer in [1, 16]")
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    if not 0.0 <= temperature <= 2.0:
        raise RequestError("temperature must be in [0, 2]")
    seed = body.get("seed")
    return ChatRequest(str(body["model"]), messages, max_tokens, temperature, n,
                       None if seed is None else int(seed), bool(body.get("logprobs")))


def decode_image_url(url: str) -> np.ndarray:
    """An RGB uint8 array from a data URL (data:image/png|jpeg;base64,...)."""
    from PIL import Image

    if not isinstance(url, str) or not url.startswith("data:"):
        raise RequestError("image_url must be a data URL (data:image/png;base64,...): this "
                           "server does not fetch remote images", code="invalid_image")
    head, _, data = url.partition(",")
    mime = head[5:].split(";")[0].lower()
    if mime not in IMAGE_TYPES or ";base64" not in head:
        raise RequestError(f"image data URL of type {mime or '?'}: send base64 PNG or JPEG",
                           code="invalid_image")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        return np.array(image.convert("RGB"))  # a writable copy
    except (binascii.Error, ValueError, OSError) as err:
        raise RequestError(f"image data URL could not be decoded ({type(err).__name__})",
                           code="invalid_image") from None


def _parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError("message content must be a string or a list of content parts")
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
            raise RequestError("content parts must be {'type': 'text'} or {'type': 'image_url'}")
    return content


def _image_url(part: dict[str, Any]) -> Any:
    """The part's URL as the client sent it (decode_image_url checks that it is a string)."""
    value = part.get("image_url")
    return value.get("url", "") if isinstance(value, dict) else value


@dataclass
class _Builder:
    tokens_T: list[int]
    types_T: list[int]
    images: list[Any]

    def text(self, processor: Any, text: str) -> None:
        ids = processor.tokenizer.encode(text, add_special_tokens=False)
        self.tokens_T += ids
        self.types_T += [0] * len(ids)

    def ids(self, ids: list[int]) -> None:
        self.tokens_T += ids
        self.types_T += [0] * len(ids)


def render_messages(processor: Any, fmt: ChatFormat, messages: list[dict[str, Any]]) -> Stream:
    """The prompt stream of a conversation, ending in an open assistant turn."""
    b = _Builder([], [], [])
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise RequestError(f"message role must be one of {list(ROLES)}, got {role!r}")
        parts = _parts(message.get("content", ""))
        b.ids([fmt.im_start])
        if role == "system":  # start_stream encodes "system\n" + text as one piece
            b.text(processor, "system\n" + "".join(p.get("text", "") for p in parts))
        else:
            b.text(processor, f"{role}\n")
            for part in parts:
                if part["type"] == "text":
                    b.text(processor, part.get("text", ""))
                elif role == "assistant":
                    raise RequestError("assistant messages cannot hold images")
                else:
                    _image(b, processor, fmt, _image_url(part))
        b.ids([fmt.im_end, *fmt.newline])
    b.ids([fmt.im_start])
    b.text(processor, "assistant\n")
    T = len(b.tokens_T)
    return Stream(tokens_T=b.tokens_T, mm_types_T=b.types_T, loss_mask_T=[0] * T,
                  logprobs_T=[0.0] * T, images=tuple(b.images))


def _image(b: _Builder, processor: Any, fmt: ChatFormat, url: str) -> None:
    vision = encode_image(processor, decode_image_url(url))
    n = vision.n_patches // fmt.merge**2
    b.tokens_T += [fmt.vision_start, *[fmt.image_pad] * n, fmt.vision_end]
    b.types_T += [0, *[1] * n, 0]
    b.images.append(vision)


def completion_json(request: ChatRequest, processor: Any, prompt_tokens: int,
                    completions: list[Completion]) -> dict[str, Any]:
    """An OpenAI chat.completion object."""
    choices = []
    for i, c in enumerate(completions):
        text = processor.tokenizer.decode(c.tokens, skip_special_tokens=True)
        choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": text},
                                  "finish_reason": c.stop_reason, "logprobs": None}
        if request.logprobs:
            choice["logprobs"] = {"content": [
                {"token": processor.tokenizer.decode([t]), "logprob": lp, "bytes": None,
                 "top_logprobs": []} for t, lp in zip(c.tokens, c.logprobs)]}
        choices.append(choice)
    completion_tokens = sum(len(c.tokens) for c in completions)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": request.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def image_data_url(image_HW3: np.ndarray, fmt: str = "png") -> str:
    """A data URL of an RGB image (what a client puts in an image_url part)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image_HW3, dtype=np.uint8)).save(buffer, format=fmt.upper())
    mime = "jpeg" if fmt.lower() in ("jpg", "jpeg") else fmt.lower()
    return f"data:image/{mime};base64,{base64.b64encode(buffer.getvalue()).decode()}"
