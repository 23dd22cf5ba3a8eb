"""What one request may take from a replica, each limit in one place (a ServeSettings field):

    max_body_bytes     the request body: Content-Length, then the bytes read           413
    body_timeout_s     seconds for the whole body to arrive (the connection is closed)  408
    max_model_len      the context: prompt tokens + max_tokens                          400
    max_image_pixels   the pixels of a request's images, from each header before it
                       is decoded                                                       400
    max_queue          requests a replica holds at once, running or waiting             429
    request_timeout_s  seconds from admission to reply, checked while waiting for the
                       engine and between decode steps                                  504

The prompt is measured while it is rendered (`serve.chat.render_messages` with `PromptLimits`)
and refused as soon as it must be too long: before a text is tokenized, `TextBound` gives a
lower bound on its tokens from its length alone, so a megabyte of text is refused without
running the tokenizer and never reaches the model.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from workbench.serve.errors import RequestError

RETRY_AFTER_S = 1  # what a refused request's Retry-After header says
KEEPS_EVERY_CHAR = ("ByteLevel", "Metaspace", "Digits", "Punctuation", "Split")
"""Pre-tokenizers that split text without dropping characters (Split unless 'Removed')."""


@dataclass(frozen=True)
class TextBound:
    """A lower bound on the tokens of a text, without tokenizing it. For a BPE tokenizer with no
    normalizer and a pre-tokenizer that drops no character, the text is cut at its added
    (special) tokens, each one token, and every other token stands for at most `vocab_chars`
    characters (its vocabulary entry's length: bytes for byte-level BPE)."""

    vocab_chars: int  # the longest entry of the BPE vocabulary
    added: tuple[str, ...]  # the added tokens' texts

    def min_tokens(self, text: str) -> int:
        """Tokens `text` encodes to, at least. str.count finds the most non-overlapping matches
        of a token, so `covered` is at least the characters the added tokens take."""
        covered = sum(text.count(s) * len(s) for s in self.added)
        return max(0, math.ceil((len(text) - covered) / self.vocab_chars))


def text_bound(tokenizer: Any) -> TextBound | None:
    """The TextBound of a fast tokenizer, or None where none is proven here (another model
    type, a normalizer, a pre-tokenizer that drops characters, fused unknowns): its texts are
    then tokenized before they are measured."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE" or model.get("fuse_unk") or spec.get("normalizer"):
        return None
    if not _keeps_every_char(spec.get("pre_tokenizer")):
        return None
    added = tuple(token["content"] for token in spec["added_tokens"])
    return TextBound(max(map(len, model["vocab"])), added)


def _keeps_every_char(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre["type"] == "Sequence":
        return all(_keeps_every_char(p) for p in pre["pretokenizers"])
    return pre["type"] in KEEPS_EVERY_CHAR and pre.get("behavior") != "Removed"


@dataclass(frozen=True)
class PromptLimits:
    """What the prompt of one request may hold, checked while it is rendered."""

    max_len: int = sys.maxsize  # context in tokens: prompt + max_tokens
    max_tokens: int = 0  # the request's reply cap
    max_image_pixels: int = sys.maxsize  # pixels of all the request's images together
    bound: TextBound | None = None  # tokens of a text before it is tokenized (None: 0)

    def min_tokens(self, text: str) -> int:
        """Tokens `text` encodes to, at least (0 without a bound)."""
        return self.bound.min_tokens(text) if self.bound is not None else 0

    def check_tokens(self, prompt_tokens: int) -> None:
        """400 once the prompt so far (at least `prompt_tokens`) leaves no room for max_tokens:
        OpenAI's message, which names the context and the tokens asked."""
        if prompt_tokens + self.max_tokens > self.max_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_len} tokens (max_model_len). "
                f"However, you requested at least {prompt_tokens + self.max_tokens} tokens "
                f"({prompt_tokens} or more in the messages, "
                f"{self.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.", code="context_length_exceeded")

    def check_pixels(self, pixels: int, size: tuple[int, int], index: int) -> None:
        """400 when the images so far (`pixels`, with image `index` of `size`) are too many."""
        if pixels > self.max_image_pixels:
            raise RequestError(
                f"image {index} is {size[0]} x {size[1]} pixels, and the request's images hold "
                f"{pixels:,} pixels: this server takes at most {self.max_image_pixels:,} pixels "
                "of images per request (max_image_pixels)", code="image_too_large")


class ClientGone(RequestError):
    """The client disconnected before its body had come: nobody to answer (one log line)."""

    def __init__(self, size: int, declared: str) -> None:
        super().__init__(f"client disconnected mid-body ({size:,} of {declared or '?'} bytes)",
                         status=499, code="client_closed_request")


async def read_body(request: Any, limit: int, timeout_s: float) -> bytes:
    """The body of a starlette Request, refused (413) past `limit` bytes: at once when its
    Content-Length says so, else once that many bytes have come (a chunked or lying body).
    The whole body must arrive within `timeout_s` of the headers: a client that stops sending
    gets 408 and its connection is closed (it holds no handle and no slot past that); one that
    disconnects is a `ClientGone`."""
    import asyncio

    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"Content-Length {int(declared):,}", limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(f"more than {limit:,} bytes read", limit)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(f"the request body did not arrive within {timeout_s:g} s "
                           f"(body_timeout_s): {size:,} of {declared or '?'} bytes came",
                           status=408, code="body_timeout",
                           headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise ClientGone(size, declared) from None
    return b"".join(chunks)


def _too_large(what: str, limit: int) -> RequestError:
    return RequestError(f"the request body is too large ({what}): this server takes at most "
                        f"{limit:,} bytes (max_body_bytes)", status=413, code="request_too_large")


def parse_json(body: bytes) -> Any:
    """The JSON value of a body; 400 when it is not JSON (or nests past Python's recursion)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise RequestError("the request body is not valid JSON") from None


@dataclass
class Gate:
    """The requests a replica holds at once (running or waiting for the engine): one past
    `limit` is refused at once with 429 and Retry-After. Entered and left on the app's event
    loop, so a plain counter is enough."""

    limit: int
    held: int = 0
    refused: int = 0

    def enter(self) -> None:
        """Hold one more request, or 429 when `limit` are held (a stream holds its place until
        it ends: `leave`)."""
        if self.held >= self.limit:
            self.refused += 1
            raise RequestError(f"this server holds {self.held} requests, its limit "
                               f"(max_queue {self.limit}): retry after {RETRY_AFTER_S} s",
                               status=429, code="queue_full", kind="rate_limit_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
        self.held += 1

    def leave(self) -> None:
        self.held -= 1

    @contextmanager
    def admit(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()


def timeout_error(timeout_s: float, where: str) -> RequestError:
    """504: the request ran past request_timeout_s (`where`: what it was doing)."""
    return RequestError(f"the request ran past this server's request_timeout_s of {timeout_s:g} "
                        f"s ({where}) and was stopped: retry with a smaller max_tokens or n, or "
                        "later", status=504, code="timeout", kind="timeout_error")


def remaining_s(deadline: float) -> float:
    """Seconds left before `deadline` (time.monotonic()), at least 0."""
    return max(0.0, deadline - time.monotonic())


@contextmanager
def held(lock: threading.Lock, deadline: float, timeout_s: float, what: str) -> Iterator[None]:
    """`lock`, waited for until `deadline` at most (then 504: `timeout_s` is what it says)."""
    wait_s = min(remaining_s(deadline), threading.TIMEOUT_MAX)
    if wait_s == 0 or not lock.acquire(timeout=wait_s):
        raise timeout_error(timeout_s, f"waiting for {what}")
    try:
        yield
    finally:
        lock.release()
