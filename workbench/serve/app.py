"""The OpenAI-compatible HTTP app over one engine: a plain FastAPI (ASGI) app, so it runs under
Ray Serve (`@serve.ingress`), under uvicorn, or in a test client without either.

    GET  /v1/models             the base, <base>:<adapter> for each published adapter
    POST /v1/chat/completions   OpenAI chat completions (text and image_url data-URL parts);
                                "stream": true: chat.completion.chunk events (`serve.stream`)
    GET  /v1/stats              this replica's counters (adapter cache hits / misses / loads /
                                evictions, requests in flight and refused for a full queue)
    GET  /health                200 {"status": "ok"} without the API key: answered on the event
                                loop, never by the engine (a liveness / readiness probe)
    GET  /metrics               Prometheus text of this app's registry (`workbench.serve.metrics`:
                                requests, refusals, queue depth, latency, tokens, adapters);
                                it needs the API key when one is set (a scrape sends it as a
                                bearer token)

With the transformers engine a chat request runs on the engine's one worker thread (the engine
takes one at a time: the others wait as futures, not as blocked threads, and the prompts' images
are decoded on that one thread); with vllm the route awaits vLLM's async engine, so requests in
flight batch together.
Before either, a request is measured against the limits of `workbench.serve.limits`: its body
as it is read, then its shape, a lower bound on its tokens and its images' pixels (from their
headers) before it enters the queue, whose length is bounded too; the exact context check comes
as the prompt is tokenized, and the time limit while it waits and runs.

Errors are OpenAI-shaped JSON: {"error": {"message", "type", "code", "param"}} with 400 (bad
request, a prompt past the context, images past max_image_pixels), 401 (API key missing or
wrong, on every path but /health), 404 (unknown model or adapter), 408 (the body did not
arrive within body_timeout_s: the connection is closed), 413 (body past max_body_bytes), 422 (a
broken, incomplete or foreign-base adapter: the server keeps running), 429 with Retry-After
(max_queue requests already held), 504 (past request_timeout_s) or 500. Each answer is counted
in the app's metrics: the handlers note its error code in request.state, the outermost
middleware records it.
"""

import asyncio
import hmac  # no `from __future__ import annotations`: FastAPI reads the route annotations
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from workbench.deps import require
from workbench.serve.chat import ChatRequest, measure_messages, parse_request
from workbench.serve.engine import (
    Replica,
    answer_stream,
    engine_stats,
    generate,
    key_hash,
    list_models,
    prompt_limits,
)
from workbench.serve.errors import RequestError, error_body
from workbench.serve.limits import ClientGone, Gate, parse_json, read_body
from workbench.serve.metrics import (
    CHAT_PATH,
    ServeMetrics,
    open_metrics,
    record_answer,
    record_first_token,
    record_reply,
    record_stream,
    scrape,
)
from workbench.serve.stream import (
    Chunks,
    Events,
    first_event,
    produce,
    produce_async,
    sse_body,
    streaming_response,
)
from workbench.serve.vllm_async import answer_stream_vllm, generate_vllm

LOG = logging.getLogger("workbench.serve")
HEALTH_PATH = "/health"  # the one path answered without the API key


def authorized(header: str, api_key_sha256: str) -> bool:
    """True when no key is set, or the Authorization header is `Bearer <the key>`."""
    if not api_key_sha256:
        return True
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key_hash(token.strip()),
                                                              api_key_sha256)


def build_app(engine: Replica) -> Any:
    """The FastAPI app serving `engine`, with its own queue bound and metrics registry."""
    fastapi = require("fastapi")

    app = fastapi.FastAPI(title="workbench", docs_url=None, redoc_url=None, openapi_url=None)
    gate = Gate(engine.settings.max_queue)
    metrics = open_metrics(engine, gate)
    _add_middleware(app, engine, metrics)
    _add_error_handlers(app)
    _add_openai_routes(app, engine, gate, metrics)
    _add_replica_routes(app, engine, gate, metrics)
    return app


def _add_middleware(app: Any, engine: Replica, metrics: ServeMetrics) -> None:
    """The API key (every path but /health), then, outermost, the metrics of every answer."""
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def check_key(request: Any, call_next: Any) -> Any:
        if request.url.path != HEALTH_PATH and not authorized(
                request.headers.get("authorization", ""), engine.settings.api_key_sha256):
            request.state.error_code = "invalid_api_key"
            return JSONResponse(error_body("missing or wrong API key: send the header "
                                           "'Authorization: Bearer <key>'", "invalid_api_key"),
                                status_code=401)
        return await call_next(request)

    @app.middleware("http")
    async def observe(request: Any, call_next: Any) -> Any:
        request.state.started = time.perf_counter()
        try:
            response = await call_next(request)
        except Exception:  # answered 500 by internal_error, outside the middleware
            _record(metrics, request, 500)
            raise
        _record(metrics, request, response.status_code)
        return response


def _record(metrics: ServeMetrics, request: Any, status: int) -> None:
    """The answer to `request` in `metrics`, with what the route and the handlers noted in
    request.state (the model asked for, the error code)."""
    state = request.state
    elapsed = None if getattr(state, "streamed", False) else time.perf_counter() - state.started
    record_answer(metrics, request.url.path, getattr(state, "model", ""), status,
                  getattr(state, "error_code", ""), elapsed)


def _add_error_handlers(app: Any) -> None:
    """OpenAI's error JSON for a RequestError (its status and code) and for anything else
    (500); the code is noted in request.state for the metrics."""
    from fastapi.responses import JSONResponse, Response

    @app.exception_handler(RequestError)
    async def request_error(request: Any, err: RequestError) -> Any:
        request.state.error_code = err.code
        if isinstance(err, ClientGone):  # nobody to answer: one line, no traceback
            LOG.warning("workbench serve: %s", err)
            return Response(status_code=err.status)
        return JSONResponse(error_body(str(err), err.code, err.kind), status_code=err.status,
                            headers=err.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Any, err: Exception) -> Any:
        return JSONResponse(error_body(f"internal error: {type(err).__name__}", "internal_error",
                                       "server_error"), status_code=500)


def _add_openai_routes(app: Any, engine: Replica, gate: Gate, metrics: ServeMetrics) -> None:
    """/v1/models and /v1/chat/completions."""
    from fastapi.concurrency import run_in_threadpool
    from starlette.requests import Request

    worker = ThreadPoolExecutor(1, thread_name_prefix="workbench-engine")  # transformers

    @app.get("/v1/models")
    async def models() -> Any:
        return await run_in_threadpool(list_models, engine)

    @app.post(CHAT_PATH)
    async def chat(request: Request) -> Any:
        s = engine.settings
        body = parse_json(await read_body(request, s.max_body_bytes, s.body_timeout_s))
        parsed = parse_request(body, s.default_max_tokens, s.max_tokens_limit)
        request.state.model = parsed.model
        limits = prompt_limits(engine, parsed)  # refused here, the queue is never entered
        await run_in_threadpool(measure_messages, parsed.messages, limits)
        if parsed.stream:
            request.state.streamed = True
            return await open_stream(engine, parsed, gate, worker, metrics,
                                     request.state.started)
        with gate.admit():
            deadline = time.monotonic() + s.request_timeout_s
            if engine.backend is not None:  # vllm: awaited, never behind the engine's lock
                reply = await generate_vllm(engine, parsed, deadline)
            else:
                loop = asyncio.get_running_loop()
                reply = await loop.run_in_executor(worker, generate, engine, parsed, deadline)
        record_reply(metrics, parsed.model, reply, time.perf_counter() - request.state.started)
        return reply


async def open_stream(engine: Replica, parsed: ChatRequest, gate: Gate, worker: Any,
                      metrics: ServeMetrics, started: float) -> Any:
    """A streamed reply (`serve.stream`): its place in the queue is held until the stream ends;
    the engine's answer runs on the engine's worker (transformers) or as a task (vllm); an
    error before the prompt is rendered is the request's HTTP error."""
    gate.enter()
    deadline = time.monotonic() + engine.settings.request_timeout_s
    events = Events(asyncio.get_running_loop())
    task: asyncio.Future[None]
    if engine.backend is not None:
        task = asyncio.create_task(produce_async(
            events, partial(answer_stream_vllm, engine, parsed, deadline)))
    else:
        task = asyncio.get_running_loop().run_in_executor(
            worker, produce, events, partial(answer_stream, engine, parsed, deadline))
    chunks: list[Chunks] = []

    def close() -> None:
        events.gone.set()  # the worker stops at its next step; the vLLM task is cancelled
        task.cancel()
        gate.leave()
        if chunks:
            record_stream(metrics, parsed.model, chunks[0].prompt_tokens,
                          chunks[0].completion_tokens(), time.perf_counter() - started)

    try:
        start = await first_event(events, deadline)
    except BaseException:
        close()
        raise
    chunks.append(Chunks(parsed, engine.lm.processor.tokenizer, start.prompt_tokens))
    first_token = partial(record_first_token, metrics, parsed.model, started)
    return streaming_response(sse_body(chunks[0], events, first_token), deadline, close)


def _add_replica_routes(app: Any, engine: Replica, gate: Gate, metrics: ServeMetrics) -> None:
    """/health (no key, no engine), /metrics (Prometheus) and /v1/stats."""
    from fastapi.responses import Response
    from starlette.requests import Request

    @app.get(HEALTH_PATH)
    async def health() -> Any:
        return {"status": "ok"}  # on the event loop: answers while the engine is busy

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Any:
        body, content_type = scrape(metrics, request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    @app.get("/v1/stats")
    async def stats() -> Any:
        return engine_stats(engine) | {"in_flight": gate.held, "max_queue": gate.limit,
                                       "refused_queue_full": gate.refused}
