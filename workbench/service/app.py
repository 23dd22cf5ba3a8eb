"""The session server's HTTP app: the endpoints of the tinker API that the official `tinker`
SDK (0.38.0) calls, over one `Service`. A plain FastAPI app, served by uvicorn.

Served (all under /api/v1; docs/service.md lists what each does):

    POST client/config, client/dynamic_config     what the SDK asks before anything else
    POST create_session, session_heartbeat, sessions/{id}/finish, telemetry
    GET  get_server_capabilities, healthz
    POST create_model, get_info                    a LoRA training client on the served base
    POST forward_backward (protobuf; forward_only: forward), optim_step
    POST save_weights, load_weights, save_weights_for_sampler
    POST create_sampling_session, asample           GET samplers/{id}
    POST retrieve_future                           a call's result, held up to poll_s
    GET  training_runs/{model_id}/checkpoints       saved states, also after a restart
    GET  sessions/{id}/usage, usage                 tokens by session (workbench's own)

Any other path answers 404 naming it as not supported. A request is read against the limits
of `ServiceSettings` (its body's size and arrival time, its images' pixels, the queue) and
checked whole before it is queued: a malformed one gets a 4xx with a message naming the field.
"""

import asyncio  # no `from __future__ import annotations`: FastAPI reads the route annotations
import contextlib
import hmac
import logging
from typing import Any

from workbench.deps import require
from workbench.serve.engine import key_hash
from workbench.serve.errors import RequestError
from workbench.serve.limits import ClientGone, parse_json, read_body
from workbench.service import wire
from workbench.service.service import Service, ServiceError
from workbench.session.checkpoint import IncompleteCheckpoint
from workbench.session.types import AdamParams

LOG = logging.getLogger("workbench.service")
PROTOBUF = "application/x-protobuf"
ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


def field(body: Any, key: str, kind: Any, default: Any = ..., where: str = "") -> Any:
    """body[key] checked against `kind` (a type or a tuple of types), or `default` when absent
    (no default: required); a 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise ServiceError(f"{where or 'the request body'} must be a JSON object")
    if key not in body or body[key] is None:
        if default is ...:
            raise ServiceError(f"{where}{key} is required")
        return default
    value = body[key]
    if isinstance(value, bool) and kind in (int, float):
        raise ServiceError(f"{where}{key} must be a {kind.__name__}, not a boolean")
    if kind is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, kind):
        name = getattr(kind, "__name__", str(kind))
        raise ServiceError(f"{where}{key} must be a {name}, got {type(value).__name__}")
    return value


def build_app(service: Service, processor: Any, fmt: Any, tokenizer_dir: str,
              max_context: int, vocab: int) -> Any:
    """The FastAPI app of `service` (the policy's processor and chat format read the images;
    token ids are checked against `vocab`, the model's embedding rows; `tokenizer_dir` is what
    get_info names for the SDK's get_tokenizer)."""
    fastapi = require("fastapi")
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import Request

    s = service.settings
    images = wire.ImageCache()  # each image a conversation sends again is read once

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> Any:
        """Beside the routes: end the sessions whose heartbeats stopped (`Service.expire`)."""
        async def reap() -> None:
            while True:
                await asyncio.sleep(min(1.0, s.session_timeout_s / 4))
                for sid in service.expire():
                    LOG.warning("workbench session-server: session %s ended: no heartbeat for "
                                "%g s", sid, s.session_timeout_s)
        task = asyncio.get_running_loop().create_task(reap())
        yield
        task.cancel()

    app = fastapi.FastAPI(title="workbench session server", docs_url=None, redoc_url=None,
                          openapi_url=None, lifespan=lifespan)

    def error(message: str, status: int, headers: dict | None = None) -> Any:
        return JSONResponse({"detail": message}, status_code=status, headers=headers or {})

    @app.middleware("http")
    async def check_key(request: Any, call_next: Any) -> Any:
        if s.api_key_sha256 and not hmac.compare_digest(
                key_hash(request.headers.get("x-api-key", "")), s.api_key_sha256):
            return error("missing or wrong API key: send the header 'X-API-Key: <key>' "
                         "(the SDK's api_key, or TINKER_API_KEY)", 401)
        return await call_next(request)

    @app.exception_handler(wire.WireError)
    async def wire_error(_: Any, err: wire.WireError) -> Any:
        return error(str(err), 400)

    @app.exception_handler(RequestError)
    async def request_error(_: Any, err: RequestError) -> Any:
        if isinstance(err, ClientGone):  # nobody to answer: one line, no traceback
            LOG.warning("workbench session-server: %s", err)
            return Response(status_code=err.status)
        return error(str(err), err.status, err.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Any, err: Exception) -> Any:
        LOG.exception("workbench session-server: internal error")
        return error(f"internal error: {type(err).__name__}", 500)

    async def body_of(request: Any) -> bytes:
        return await read_body(request, s.max_body_bytes, s.body_timeout_s)

    async def json_of(request: Any) -> Any:
        body = parse_json(await body_of(request))
        if not isinstance(body, dict):
            raise ServiceError("the request body must be a JSON object")
        return body

    def future(request_id: str, **extra: Any) -> dict[str, Any]:
        return {"request_id": request_id, **extra}

    # ------------------------------------------------------------------ the SDK's session

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> Any:
        await body_of(request)
        return {"pjwt_auth_enabled": False, "use_pyqwest_transport": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> Any:
        await body_of(request)
        return {}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> Any:
        await json_of(request)
        return {"type": "create_session", "session_id": service.create_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        service.heartbeat(field(await json_of(request), "session_id", str))
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> Any:
        await body_of(request)
        service.client(session_id)
        service.end_session(session_id, "finished by the client")
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request) -> Any:
        await body_of(request)
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> Any:
        return {"supported_models": [{"model_name": service.base_model, "trainable": True,
                                      "sampleable": True, "max_context_length": max_context}]}

    @app.get("/api/v1/healthz")
    async def healthz() -> Any:
        return {"status": "ok"}

    # ---------------------------------------------------------------- training clients

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> Any:
        body = await json_of(request)
        lora = field(body, "lora_config", dict, {})
        for part in ("train_unembed", "train_mlp", "train_attn"):
            if field(lora, part, bool, True, "lora_config.") is False:
                raise ServiceError(f"lora_config.{part}=false is not served: this server's "
                                   "adapters cover the attention and MLP projections, as its "
                                   "base's LoRA does")
        optimizer = field(body, "optimizer_config", dict, {"type": "adamw"})
        if optimizer.get("type", "adamw") != "adamw":
            raise ServiceError(f"optimizer {optimizer.get('type')!r} is not served: adamw only")
        model_id, call = service.create_model(
            field(body, "session_id", str), field(body, "model_seq_id", int),
            field(body, "base_model", str), field(lora, "rank", int, 0, "lora_config."),
            field(lora, "seed", int, None, "lora_config."))
        return future(call.request_id, model_id=model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> Any:
        return service.info(field(await json_of(request), "model_id", str), tokenizer_dir)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> Any:
        if "protobuf" not in request.headers.get("content-type", ""):
            raise ServiceError(f"forward_backward takes a protobuf body ({PROTOBUF})", 415)
        if request.headers.get("content-encoding", "identity") != "identity":
            raise ServiceError("compressed bodies are not taken: this server tells the SDK "
                               "proto_compress_fwdbwd=false", 415)
        body = await body_of(request)
        message, datums, known = await run_in_threadpool(read_forward, body)
        what = "forward" if message.forward_only else "forward_backward"
        rid = service.train(message.model_id, message.seq_id, what, datums, known,
                            message.loss_fn, loss_config(message))
        return future(rid, model_id=message.model_id)

    def read_forward(body: bytes) -> tuple[Any, list, list]:
        from google.protobuf.message import DecodeError
        from tinker.proto import tinker_public_pb2 as pb

        message = pb.ForwardBackwardRequest()
        try:
            message.ParseFromString(body)
        except DecodeError:
            raise ServiceError("the body is not a tinker ForwardBackwardRequest") from None
        if not message.data:
            raise ServiceError("forward_backward needs at least one datum")
        loss_config(message)  # the loss and its keys are checked before the datums are read
        datums, known = [], []
        for i, d in enumerate(message.data):
            where = f"data[{i}]"
            stream = wire.read_stream(wire.chunks_from_proto(d.model_input,
                                                             f"{where}.model_input"),
                                      processor, fmt, vocab, s.max_image_pixels,
                                      f"{where}.model_input", images)
            inputs = {k: wire.tensor_from_proto(t, f"{where}.loss_fn_inputs[{k!r}]")
                      for k, t in d.loss_fn_inputs.items()}
            datum, ok = wire.read_datum(stream, inputs, message.loss_fn, where)
            datums.append(datum)
            known.append(ok)
        return message, datums, known

    def loss_config(message: Any) -> Any:
        config = {k: v.number for k, v in message.loss_fn_config_v2.items()
                  if v.WhichOneof("value") == "number"}
        config |= {k: v for k, v in message.loss_fn_config.items()}
        text = [k for k, v in message.loss_fn_config_v2.items() if v.WhichOneof("value") == "text"]
        if text:
            raise ServiceError(f"loss_fn_config {text} hold text: numbers only")
        return wire.loss_config(message.loss_fn, config)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> Any:
        body = await json_of(request)
        params = field(body, "adam_params", dict)
        unknown = sorted(set(params) - set(ADAM_KEYS) - {"type"})
        if unknown:
            raise ServiceError(f"adam_params {unknown} are not known: {list(ADAM_KEYS)}")
        adam = AdamParams(**{k: field(params, k, float, getattr(AdamParams(), k), "adam_params.")
                             for k in ADAM_KEYS})
        model_id = field(body, "model_id", str)
        rid = service.train(model_id, field(body, "seq_id", int), "optim_step", adam)
        return future(rid, model_id=model_id)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> Any:
        body = await json_of(request)
        model_id = field(body, "model_id", str)
        rid = service.train(model_id, field(body, "seq_id", int), "save_weights",
                            field(body, "path", str))
        return future(rid, model_id=model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> Any:
        body = await json_of(request)
        model_id = field(body, "model_id", str)
        name = field(body, "path", str, "")
        sampler_seq = field(body, "sampling_session_seq_id", int, None)
        if not name and sampler_seq is None:
            raise ServiceError("save_weights_for_sampler needs a path or a "
                               "sampling_session_seq_id")
        rid = service.train(model_id, field(body, "seq_id", int), "save_weights_for_sampler",
                            name, sampler_seq)
        return future(rid, model_id=model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> Any:
        body = await json_of(request)
        path, optimizer = field(body, "path", str), field(body, "optimizer", bool, True)
        if "model_id" in body:  # TrainingClient.load_state: into this client, in its order
            model_id = field(body, "model_id", str)
            rid = service.train(model_id, field(body, "seq_id", int), "load_weights", path,
                                optimizer)
            return future(rid, model_id=model_id)
        model_id, call = service.load_model(field(body, "session_id", str),
                                            field(body, "model_seq_id", int), path, optimizer)
        return future(call.request_id, model_id=model_id)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str) -> Any:
        return {"checkpoints": service.checkpoints(model_id), "cursor": None}

    # ------------------------------------------------------------------------ sampling

    @app.post("/api/v1/create_sampling_session")
    async def create_sampler(request: Request) -> Any:
        body = await json_of(request)
        session_id = field(body, "session_id", str)
        sampler_id, version = service.start_sampler(
            session_id, field(body, "sampling_session_seq_id", int),
            field(body, "base_model", str, None), field(body, "model_path", str, None))
        service.add_sampler(session_id, sampler_id, await asyncio.wrap_future(version))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> Any:
        service.sampler(sampler_id)
        return {"sampler_id": sampler_id, "base_model": service.base_model, "model_path": None}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> Any:
        body = await json_of(request)
        sampler_id = field(body, "sampling_session_id", str)
        service.sampler(sampler_id)  # 404 before the prompt's images are read
        n = field(body, "num_samples", int, 1)
        if not 1 <= n <= 64:
            raise ServiceError(f"num_samples {n}: 1 to 64")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if field(body, key, int, 0):
                raise ServiceError(f"{key} is not served: 0 only")
        if body.get("target_prompt_logprobs") is not None or \
                body.get("prompt_logprobs_last_n") is not None:
            raise ServiceError("target_prompt_logprobs and prompt_logprobs_last_n are not "
                               "served")
        params = sampling_params(field(body, "sampling_params", dict, {}))
        chunks = wire.chunks_from_json(field(field(body, "prompt", dict), "chunks", list))
        prompt = await run_in_threadpool(wire.read_stream, chunks, processor, fmt, vocab,
                                         s.max_image_pixels, "prompt.chunks", images)
        if len(prompt) + params[0].max_tokens > max_context:
            raise ServiceError(f"the prompt's {len(prompt)} tokens and max_tokens "
                               f"{params[0].max_tokens} pass this server's context of "
                               f"{max_context} tokens")
        rid = service.sample(sampler_id, field(body, "seq_id", int, 0), prompt, n, *params,
                             field(body, "prompt_logprobs", bool, False))
        return future(rid, sample_sequence_ids=[f"{rid}-{k}" for k in range(n)])

    def sampling_params(p: dict) -> tuple[Any, Any]:
        from workbench.policy import SamplingParams

        where = "sampling_params."
        if field(p, "top_k", int, -1, where) not in (-1, 0) or \
                field(p, "top_p", float, 1.0, where) != 1.0:
            raise ServiceError("top_k and top_p are not served: the sampler draws from the "
                               "whole distribution at the temperature")
        stop = p.get("stop")
        im_end = processor.tokenizer.convert_ids_to_tokens(fmt.im_end)
        if stop is not None and not (isinstance(stop, (list, str)) and stop and all(
                s_ in (fmt.im_end, im_end) for s_ in ([stop] if isinstance(stop, str) else stop))):
            raise ServiceError(f"stop {stop!r} is not served: this server's sampler stops at "
                               f"{im_end} (token {fmt.im_end}) only; leave stop out or name it")
        max_tokens = field(p, "max_tokens", int, s.default_max_tokens, where)
        temperature = field(p, "temperature", float, 1.0, where)
        if max_tokens < 1 or temperature < 0:
            raise ServiceError("max_tokens must be at least 1 and temperature at least 0")
        return SamplingParams(max_tokens=max_tokens, temperature=temperature), \
            field(p, "seed", int, None, where)

    # ------------------------------------------------------------------------- results

    @app.post("/api/v1/retrieve_future")
    async def retrieve(request: Request) -> Any:
        rid = field(await json_of(request), "request_id", str)
        call = service.calls.get(rid)
        if call is None:
            raise ServiceError(f"no call {rid!r} on this server (results are kept "
                               f"{s.keep_results_s:g} s)", 404)
        done, _ = await asyncio.wait([asyncio.wrap_future(call.future)], timeout=s.poll_s)
        if not done:
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        exc = call.future.exception()
        if exc is not None:
            user = isinstance(exc, (ValueError, KeyError, IncompleteCheckpoint))
            return {"error": f"{type(exc).__name__}: {exc}",
                    "category": "user" if user else "server"}
        value = call.future.result()
        if call.kind == "forward":
            out, known, loss_fn, _ = value
            body = await run_in_threadpool(wire.forward_output, out, known, loss_fn)
            return Response(body, media_type=PROTOBUF)
        if call.kind == "sample":
            sequences, prompt_lps, _ = value
            return Response(await run_in_threadpool(wire.sample_output, sequences, prompt_lps),
                            media_type=PROTOBUF)
        return value

    # --------------------------------------------------------------------------- usage

    @app.get("/api/v1/sessions/{session_id}/usage")
    async def usage(session_id: str) -> Any:
        return service.usage(session_id)

    @app.get("/api/v1/usage")
    async def all_usage() -> Any:
        return {"sessions": [service.usage(sid) for sid in service.clients]}

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_served(path: str) -> Any:
        return error(f"/{path} is not served by this workbench session server (it serves the "
                     "tinker SDK's training and sampling calls: docs/service.md)", 404)

    return app

