"""Streamed replies (`"stream": true`): OpenAI's chat.completion.chunk objects as server-sent
events, with either engine behind them.

    data: {"object": "chat.completion.chunk", "choices": [{"index": i, "delta": {"role":
           "assistant", "content": ""}, ...}]}                        one a choice, first
    data: {... "choices": [{"index": i, "delta": {"content": "..."}, "logprobs": {"content":
           [the token]} or null, "finish_reason": null}]}             one a sampled token
    data: {... "choices": [{"index": i, "delta": {}, "finish_reason": "stop" | "length"}]}
    data: {... "choices": [], "usage": {...}}                          with include_usage
    data: [DONE]

An engine answers a streamed request with events (`Start` once its prompt is rendered, a
`Token` per sampled token of choice i, a `Finish` per choice, or `Failed`) into an `Events`
queue: the transformers engine from its one worker thread, vLLM from a task on the event loop.
An error before `Start` is the request's HTTP error, as unstreamed; after it, an `error` event
ends the stream. A choice's content deltas are its text decoded so far less what was sent, so
the text streamed equals the text of the same request unstreamed (a token that ends inside a
character waits for the next one).

The stream holds its place in the queue (`Gate`) until it ends; a client that disconnects ends
it at once: vLLM's requests are cancelled (vLLM aborts them), and the transformers engine stops
at its next decode step and takes the next request. The whole response is bounded by
request_timeout_s, sent or not (a client that reads nothing cannot hold a place).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from workbench.serve.chat import ChatRequest, logprob_entry
from workbench.serve.errors import RequestError, error_body
from workbench.serve.limits import remaining_s

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Start:
    prompt_tokens: int  # the rendered prompt's length


@dataclass(frozen=True)
class Token:
    index: int  # the choice
    token: int
    logprob: float


@dataclass(frozen=True)
class Finish:
    index: int
    reason: str  # stop | length


@dataclass(frozen=True)
class Failed:
    error: RequestError


class StreamClosed(Exception):
    """The client is gone: the engine stops producing this stream's tokens."""


@dataclass
class Events:
    """An engine's events for one streamed request, put from any thread, read on the loop;
    `gone` is set once nobody reads them any more. None ends them."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    gone: threading.Event = field(default_factory=threading.Event)

    def put(self, event: Any) -> None:
        """Queue `event` (from the loop or a worker thread); StreamClosed once the client left."""
        if self.gone.is_set():
            raise StreamClosed
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def end_events(events: Events, err: Exception | None = None) -> None:
    """End the events (from the loop or a worker thread): `Failed` first when the answer raised
    (a RequestError as it is, anything else as a 500), then None."""
    if err is not None:
        failure = err if isinstance(err, RequestError) else RequestError(
            f"internal error: {type(err).__name__}", status=500, code="internal_error",
            kind="server_error")
        events.loop.call_soon_threadsafe(events.queue.put_nowait, Failed(failure))
    events.loop.call_soon_threadsafe(events.queue.put_nowait, None)


@contextmanager
def ending(events: Events) -> Iterator[None]:
    """End the events once the engine's streamed answer inside returns (`end_events`), or with
    the error it raised; StreamClosed (the client left) ends them quietly."""
    try:
        yield
    except StreamClosed:
        return
    except Exception as err:  # noqa: BLE001 - the stream ends with the error, not the server
        end_events(events, err)
        return
    end_events(events)


def produce(events: Events, answer: Callable[[Callable[[Any], None]], None]) -> None:
    """Run `answer(put)` (an engine's streamed answer, on a worker thread), then end the events."""
    with ending(events):
        answer(events.put)


async def produce_async(events: Events, answer: Callable[[Callable[[Any], None]], Any]) -> None:
    """`produce` for an engine that answers on the event loop (`await answer(put)`)."""
    with ending(events):
        await answer(events.put)


@dataclass
class Chunks:
    """What a stream has sent so far, per choice: its tokens and its text."""

    request: ChatRequest
    tokenizer: Any
    prompt_tokens: int
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))
    tokens: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)

    def completion_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event holding `data` as JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def chunk(c: Chunks, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    """A chat.completion.chunk event with `choices`."""
    return sse({"id": c.id, "object": "chat.completion.chunk", "created": c.created,
                "model": c.request.model, "choices": choices, **extra})


def role_chunks(c: Chunks) -> list[bytes]:
    """The first event of each choice: its role."""
    return [chunk(c, [{"index": i, "delta": {"role": "assistant", "content": ""},
                       "logprobs": None, "finish_reason": None}]) for i in range(c.request.n)]


def new_text(c: Chunks, index: int, final: bool) -> str:
    """Choice `index`'s text decoded so far less what was sent (held back while it ends inside
    a character, unless `final`), recorded as sent."""
    text = c.tokenizer.decode(c.tokens.get(index, []), skip_special_tokens=True)
    sent = c.text.get(index, "")
    if not text.startswith(sent) or (text.endswith("\ufffd") and not final):
        return ""
    c.text[index] = text
    return text[len(sent):]


def token_chunk(c: Chunks, event: Token) -> bytes:
    """A sampled token: the content it adds, and its log-prob when the request asked."""
    c.tokens.setdefault(event.index, []).append(event.token)
    logprobs = {"content": [logprob_entry(c.tokenizer, event.token, event.logprob)]} \
        if c.request.logprobs else None
    return chunk(c, [{"index": event.index, "delta": {"content": new_text(c, event.index, False)},
                      "logprobs": logprobs, "finish_reason": None}])


def finish_chunk(c: Chunks, event: Finish) -> bytes:
    """A choice's last event: any text held back, and why it ended."""
    rest = new_text(c, event.index, True)
    return chunk(c, [{"index": event.index, "delta": {"content": rest} if rest else {},
                      "logprobs": None, "finish_reason": event.reason}])


def usage_chunk(c: Chunks) -> bytes:
    """The usage of the whole request (stream_options.include_usage)."""
    done = c.completion_tokens()
    return chunk(c, [], usage={"prompt_tokens": c.prompt_tokens, "completion_tokens": done,
                               "total_tokens": c.prompt_tokens + done})


def event_chunk(c: Chunks, event: Any) -> bytes:
    """The SSE bytes of one engine event after Start."""
    if isinstance(event, Token):
        return token_chunk(c, event)
    if isinstance(event, Finish):
        return finish_chunk(c, event)
    assert isinstance(event, Failed), event
    err = event.error
    return sse(error_body(str(err), err.code, err.kind))


async def first_event(events: Events, deadline: float) -> Start:
    """The engine's first event: Start, or its error raised (the request's HTTP status)."""
    try:
        event = await asyncio.wait_for(events.queue.get(), remaining_s(deadline))
    except TimeoutError:
        events.gone.set()
        raise RequestError("the request waited past this server's request_timeout_s for the "
                           "engine", status=504, code="timeout", kind="timeout_error") from None
    if isinstance(event, Failed):
        raise event.error
    assert isinstance(event, Start), event
    return event


async def sse_body(c: Chunks, events: Events,
                   on_token: Callable[[], None]) -> AsyncIterator[bytes]:
    """The stream after Start: role chunks, each event's chunk, the usage when asked, [DONE];
    `on_token()` runs at the first token."""
    for role in role_chunks(c):
        yield role
    while (event := await events.queue.get()) is not None:
        if isinstance(event, Token) and not c.tokens:
            on_token()
        yield event_chunk(c, event)
    if c.request.include_usage:
        yield usage_chunk(c)
    yield DONE


def streaming_response(body: AsyncIterator[bytes], deadline: float,
                       on_close: Callable[[], None]) -> Any:
    """A text/event-stream response of `body` that stops at once when the client disconnects
    or `deadline` passes; then `body` is closed and `on_close()` runs, however it ended."""
    import anyio
    from starlette.responses import StreamingResponse

    class BoundedStream(StreamingResponse):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                with anyio.move_on_after(remaining_s(deadline)):
                    async with anyio.create_task_group() as group:
                        async def stream() -> None:
                            await self.stream_response(send)
                            group.cancel_scope.cancel()

                        group.start_soon(stream)
                        await self.listen_for_disconnect(receive)
                        group.cancel_scope.cancel()
            finally:
                try:
                    await body.aclose()  # type: ignore[attr-defined]
                finally:
                    on_close()

    return BoundedStream(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
