"""The OpenAI-compatible HTTP app over one engine: a plain FastAPI (ASGI) app, so it runs under
Ray Serve (`@serve.ingress`), under uvicorn, or in a test client without either.

    GET  /v1/models             the base, <base>:<adapter> for each published adapter
    POST /v1/chat/completions   OpenAI chat completions (text and image_url data-URL parts)
    GET  /v1/stats              this replica's counters (adapter cache hits / misses / evictions)

With the transformers engine a chat request runs in a worker thread (the engine takes one at a
time); with vllm the route awaits vLLM's async engine, so requests in flight batch together.

Errors are OpenAI-shaped JSON: {"error": {"message", "type", "code", "param"}} with 400 (bad
request), 401 (API key missing or wrong), 404 (unknown model or adapter), 422 (a broken,
incomplete or foreign-base adapter: the server keeps running) or 500.
"""

import hmac  # no `from __future__ import annotations`: FastAPI reads the route annotations
from typing import Any

from workbench.deps import require
from workbench.serve.chat import RequestError, parse_request
from workbench.serve.engine import Engine, engine_stats, generate, key_hash, list_models
from workbench.serve.vllm_async import generate_vllm


def error_body(message: str, code: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "code": code, "param": None}}


def authorized(header: str, api_key_sha256: str) -> bool:
    """True when no key is set, or the Authorization header is `Bearer <the key>`."""
    if not api_key_sha256:
        return True
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key_hash(token.strip()),
                                                              api_key_sha256)


def build_app(engine: Engine) -> Any:
    """The FastAPI app serving `engine`."""
    fastapi = require("fastapi")
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse
    from starlette.requests import Request

    app = fastapi.FastAPI(title="workbench", docs_url=None, redoc_url=None, openapi_url=None)

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
        return JSONResponse(error_body(str(err), err.code, err.kind), status_code=err.status)

    @app.exception_handler(Exception)
    async def internal_error(_: Any, err: Exception) -> Any:
        return JSONResponse(error_body(f"internal error: {type(err).__name__}", "internal_error",
                                       "server_error"), status_code=500)

    @app.get("/v1/models")
    async def models() -> Any:
        return await run_in_threadpool(list_models, engine)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            raise RequestError("the request body is not valid JSON") from None
        s = engine.settings
        parsed = parse_request(body, s.default_max_tokens, s.max_tokens_limit)
        if engine.backend is not None:  # vllm: awaited, never behind the engine's lock
            return await generate_vllm(engine, parsed)
        return await run_in_threadpool(generate, engine, parsed)

    @app.get("/v1/stats")
    async def stats() -> Any:
        return engine_stats(engine)

    return app
