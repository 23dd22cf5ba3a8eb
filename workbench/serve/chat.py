"""OpenAI chat requests as token streams, and completions as OpenAI JSON.

`render_messages` turns `messages` (text and `image_url` content parts with PNG/JPEG data URLs)
into a `workbench.policy.Stream` with the same markup the rollouts build: a system message as
`start_stream` writes it, a user turn as `append_user` writes it (parts in the order given), an
assistant turn as its reply followed by `<|im_end|>`, and finally the open assistant header. So a
maze conversation sent turn by turn gets the tokens the policy was trained on.

`measure_messages` checks a conversation against its `PromptLimits` before any of it is
tokenized or decoded (shape, a lower bound on its tokens, its images' pixels from their
headers); `render_messages` stops at the first piece past the context.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np

from workbench.policy import ChatFormat, Completion, Stream, encode_image
from workbench.serve.errors import RequestError, shown
from workbench.serve.limits import PromptLimits

IMAGE_TYPES = ("image/png", "image/jpeg", "image/jpg")
IMAGE_FORMATS = ("PNG", "JPEG")  # what PIL may open them as
ROLES = ("system", "user", "assistant")
MAX_N = 16  # choices one request may ask for
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


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
    stream: bool = False  # the reply as chat.completion.chunk events (`serve.stream`)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def parse_request(body: Any, default_max_tokens: int, max_tokens_limit: int) -> ChatRequest:
    """Validate a chat-completions body; RequestError (400) names the bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for key in ("model", "messages"):
        if key not in body:
            raise RequestError(f"missing required field {key!r}")
    if not isinstance(body["model"], str):
        raise RequestError(f"'model' must be a string, not {shown(body['model'])}")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    max_tokens = _first(body, "max_completion_tokens", "max_tokens")
    max_tokens = _integer("max_tokens", max_tokens, 1, max_tokens_limit, default_max_tokens)
    n = _integer("n", body.get("n"), 1, MAX_N, 1)
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool)
                                    or not isinstance(temperature, (int, float))):
        raise RequestError(f"temperature must be a number in [0, 2], not {shown(temperature)}")
    temperature = 1.0 if temperature is None else float(temperature)
    if not 0.0 <= temperature <= 2.0:
        raise RequestError("temperature must be in [0, 2]")
    seed = body.get("seed")
    seed = None if seed is None else _integer("seed", seed, *SEED_RANGE, 0)
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs is not supported by this server: logprobs=true gives "
                           "each sampled token's log-prob", code="unsupported")
    stream, include_usage = _streaming(body)
    return ChatRequest(body["model"], messages, max_tokens, temperature, n, seed,
                       bool(body.get("logprobs")), stream, include_usage)


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage) of a request; 400 for a wrong type, or for
    stream_options without stream (as OpenAI's API answers)."""
    stream, options = body.get("stream", False), body.get("stream_options")
    if not isinstance(stream, bool) and stream is not None:
        raise RequestError(f"stream must be true or false, not {shown(stream)}")
    if options is None:
        return bool(stream), False
    if not stream:
        raise RequestError("stream_options is only allowed with stream=true")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(f"stream_options must be {{\"include_usage\": true|false}}, not "
                           f"{shown(options)}")
    return True, bool(options.get("include_usage", False))


def _first(body: dict[str, Any], *keys: str) -> Any:
    """The value of the first of `keys` that is present and not null."""
    return next((body[k] for k in keys if body.get(k) is not None), None)


def _integer(name: str, value: Any, low: int, high: int, default: int) -> int:
    """An integer field in [low, high] (`default` when null); 400 otherwise."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer in [{low}, {high}], not {shown(value)}")
    return value


def open_image(url: Any) -> Any:
    """A PIL image of a data URL (data:image/png|jpeg;base64,...), opened lazily: its size is
    read from the header, its pixels only on `decode_image`."""
    from PIL import Image

    if not isinstance(url, str) or not url.startswith("data:"):
        raise RequestError("image_url must be a data URL (data:image/png;base64,...): this "
                           "server does not fetch remote images", code="invalid_image")
    head, _, data = url.partition(",")
    mime = head[5:].split(";")[0].lower()
    if mime not in IMAGE_TYPES or ";base64" not in head:
        raise RequestError(f"image data URL of type {shown(mime or '?', 40)}: send base64 PNG "
                           "or JPEG", code="invalid_image")
    try:
        return Image.open(io.BytesIO(base64.b64decode(data, validate=True)),
                          formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise RequestError("the image is too large for PIL to open (a decompression bomb): "
                           "this server takes max_image_pixels at most",
                           code="image_too_large") from None
    except (binascii.Error, ValueError, OSError) as err:
        raise RequestError(f"image data URL could not be decoded ({type(err).__name__})",
                           code="invalid_image") from None


def decode_image(image: Any) -> np.ndarray:
    """The RGB uint8 pixels of an opened image (a writable copy)."""
    try:
        return np.array(image.convert("RGB"))
    except (ValueError, OSError) as err:
        raise RequestError(f"image data URL could not be decoded ({type(err).__name__})",
                           code="invalid_image") from None


def decode_image_url(url: str) -> np.ndarray:
    """An RGB uint8 array from a data URL (data:image/png|jpeg;base64,...)."""
    return decode_image(open_image(url))


def _parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError("message content must be a string or a list of content parts")
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("text", "image_url"):
            raise RequestError("content parts must be {'type': 'text'} or {'type': 'image_url'}")
        if part["type"] == "text" and not isinstance(part.get("text", ""), str):
            raise RequestError(f"a text part's 'text' must be a string, not "
                               f"{shown(part['text'])}")
    return content


def _image_url(part: dict[str, Any]) -> Any:
    """The part's URL as the client sent it (decode_image_url checks that it is a string)."""
    value = part.get("image_url")
    return value.get("url", "") if isinstance(value, dict) else value


def _pieces(message: Any) -> Iterator[tuple[str, Any]]:
    """What a message renders to between its <|im_start|> and <|im_end|>, in order: ("text",
    a string to encode) or ("image", its URL). RequestError (400) for a malformed message."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ROLES:
        raise RequestError(f"message role must be one of {list(ROLES)}, got {shown(role)}")
    parts = _parts(message.get("content", ""))
    if role == "system":  # start_stream encodes "system\n" + text as one piece
        yield "text", "system\n" + "".join(p.get("text", "") for p in parts)
        return
    yield "text", f"{role}\n"
    for part in parts:
        if part["type"] == "text":
            yield "text", part.get("text", "")
        elif role == "assistant":
            raise RequestError("assistant messages cannot hold images")
        else:
            yield "image", _image_url(part)


def measure_messages(messages: list[Any], limits: PromptLimits) -> None:
    """Refuse (400) a conversation past `limits` before any of it is tokenized or decoded: its
    shape, a lower bound on its tokens (<|im_start|> and <|im_end|> of each turn, the text bound,
    an image's start and end) and its images' pixels, read from their headers."""
    floor, pixels, images = 1, 0, 0  # the open assistant turn's <|im_start|>
    for message in messages:
        floor += 2
        for kind, value in _pieces(message):
            if kind == "text":
                floor += limits.min_tokens(value)
                continue
            size = open_image(value).size
            pixels, images, floor = pixels + size[0] * size[1], images + 1, floor + 2
            limits.check_pixels(pixels, size, images)
        limits.check_tokens(floor)


@dataclass
class _Builder:
    """A prompt stream as it is rendered, refused (RequestError) once past the context."""

    processor: Any
    limits: PromptLimits
    tokens_T: list[int] = field(default_factory=list)
    types_T: list[int] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)

    def text(self, text: str) -> None:
        self.limits.check_tokens(len(self.tokens_T) + self.limits.min_tokens(text))
        self.ids(self.processor.tokenizer.encode(text, add_special_tokens=False))

    def ids(self, ids: list[int], types: list[int] | None = None) -> None:
        self.tokens_T += ids
        self.types_T += types or [0] * len(ids)
        self.limits.check_tokens(len(self.tokens_T))

    def image(self, fmt: ChatFormat, url: Any) -> None:
        vision = encode_image(self.processor, decode_image_url(url))
        n = vision.n_patches // fmt.merge**2
        self.ids([fmt.vision_start, *[fmt.image_pad] * n, fmt.vision_end], [0, *[1] * n, 0])
        self.images.append(vision)


def render_messages(processor: Any, fmt: ChatFormat, messages: list[dict[str, Any]],
                    limits: PromptLimits | None = None) -> Stream:
    """The prompt stream of a conversation, ending in an open assistant turn; RequestError (400)
    as soon as it is past the context of `limits` (its pixels are `measure_messages`' part)."""
    b = _Builder(processor, limits or PromptLimits())
    for message in messages:
        b.ids([fmt.im_start])
        for kind, value in _pieces(message):
            if kind == "text":
                b.text(value)
            else:
                b.image(fmt, value)
        b.ids([fmt.im_end, *fmt.newline])
    b.ids([fmt.im_start])
    b.text("assistant\n")
    T = len(b.tokens_T)
    return Stream(tokens_T=b.tokens_T, mm_types_T=b.types_T, loss_mask_T=[0] * T,
                  logprobs_T=[0.0] * T, images=tuple(b.images))


def completion_json(request: ChatRequest, processor: Any, prompt_tokens: int,
                    completions: list[Completion]) -> dict[str, Any]:
    """An OpenAI chat.completion object."""
    choices = []
    for i, c in enumerate(completions):
        text = processor.tokenizer.decode(c.tokens, skip_special_tokens=True)
        choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": text},
                                  "finish_reason": c.stop_reason, "logprobs": None}
        if request.logprobs:
            choice["logprobs"] = {"content": [logprob_entry(processor.tokenizer, t, lp)
                                              for t, lp in zip(c.tokens, c.logprobs)]}
        choices.append(choice)
    completion_tokens = sum(len(c.tokens) for c in completions)
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": request.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def logprob_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    """One sampled token in OpenAI's logprobs.content (no alternatives: top_logprobs empty)."""
    return {"token": tokenizer.decode([token_id]), "logprob": logprob,
            "bytes": list(token_bytes(tokenizer, token_id)), "top_logprobs": []}


@cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable character -> the byte it stands for (GPT-2's table)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs, cs = [*bs, b], [*cs, 256 + len(cs) - 188]  # 188 printable bytes map to themselves
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The exact bytes of one token (a piece of a character stays its raw bytes): a special or
    added token's text in UTF-8, else its byte-level BPE piece mapped back to bytes."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    table = _byte_decoder()
    if token_id in tokenizer.added_tokens_decoder or not all(ch in table for ch in piece):
        return piece.encode()
    return bytes(table[ch] for ch in piece)


def image_data_url(image_HW3: np.ndarray, fmt: str = "png") -> str:
    """A data URL of an RGB image (what a client puts in an image_url part)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image_HW3, dtype=np.uint8)).save(buffer, format=fmt.upper())
    mime = "jpeg" if fmt.lower() in ("jpg", "jpeg") else fmt.lower()
    return f"data:image/{mime};base64,{base64.b64encode(buffer.getvalue()).decode()}"
