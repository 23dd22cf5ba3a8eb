"""The OpenAI-compatible HTTP app over one engine: a plain FastAPI (ASGI) app, so it runs under
Ray Serve (`@serve.ingress`), under uvicorn, or in a test client without either.

    GET  /v1/models             the base, <base>:<adapter> for each published adapter
    POST /v1/chat/completions   OpenAI chat completions (text and image_url data-URL parts)
    GET  /v1/stats              this replica's counters (adapter cache hits / misses / evictions,
                                requests in flight and refused for a full queue)

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
wrong), 404 (unknown model or adapter), 408 (the body did not arrive within body_timeout_s:
the connection is closed), 413 (body past max_body_bytes), 422 (a broken,
incomplete or foreign-base adapter: the server keeps running), 429 with Retry-After (max_queue
requests already held), 504 (past request_timeout_s) or 500.
"""

import asyncio
import hmac  # no `from __future__ import annotations`: FastAPI reads the route annotations
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workbench.deps import require
from workbench.serve.chat import measure_messages, parse_request
from workbench.serve.engine import (
    Replica,
    engine_stats,
    generate,
    key_hash,
    list_models,
    prompt_limits,
)
from workbench.serve.errors import RequestError, error_body
from workbench.serve.limits import ClientGone, Gate, parse_json, read_body
from workbench.serve.vllm_async import generate_vllm

LOG = logging.getLogger("workbench.serve")


def authorized(header: str, api_key_sha256: str) -> bool:
    """True when no key is set, or the Authorization header is `Bearer <the key>`."""
    if not api_key_sha256:
        return True
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key_hash(token.strip()),
                                                              api_key_sha256)


def build_app(engine: Replica) -> Any:
    """The FastAPI app serving `engine`."""
    fastapi = require("fastapi")
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import Request

    app = fastapi.FastAPI(title="workbench", docs_url=None, redoc_url=None, openapi_url=None)
    gate = Gate(engine.settings.max_queue)
    worker = ThreadPoolExecutor(1, thread_name_prefix="workbench-engine")  # transformers

    @app.middleware("http")
    async def check_key(request: Any, call_next: Any) -> Any:
        if not authorized(request.headers.get("authorization", ""),
                          engine.settings.api_key_sha256):
            return JSONResponse(error_body("missing or wrong API key: send the header "
                                           "'Authorization: Bearer <key>'", "invalid_api_key"),
                                status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestError)
    async def request_error(_: Any, err: RequestError) -> Any:
        if isinstance(err, ClientGone):  # nobody to answer: one line, no traceback
            LOG.warning("workbench serve: %s", err)
            return Response(status_code=err.status)
        return JSONResponse(error_body(str(err), err.code, err.kind), status_code=err.status,
                            headers=err.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Any, err: Exception) -> Any:
        return JSONResponse(error_body(f"internal error: {type(err).__name__}", "internal_error",
                                       "server_error"), status_code=500)

    @app.get("/v1/models")
    async def models() -> Any:
        return await run_in_threadpool(list_models, engine)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        s = engine.settings
        body = parse_json(await read_body(request, s.max_body_bytes, s.body_timeout_s))
        parsed = parse_request(body, s.default_max_tokens, s.max_tokens_limit)
        limits = prompt_limits(engine, parsed)  # refused here, the queue is never entered
        await run_in_threadpool(measure_messages, parsed.messages, limits)
        with gate.admit():
            deadline = time.monotonic() + s.request_timeout_s
            if engine.backend is not None:  # vllm: awaited, never behind the engine's lock
                return await generate_vllm(engine, parsed, deadline)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(worker, generate, engine, parsed, deadline)

    @app.get("/v1/stats")
    async def stats() -> Any:
        return engine_stats(engine) | {"in_flight": gate.held, "max_queue": gate.limit,
                                       "refused_queue_full": gate.refused}

    return app
