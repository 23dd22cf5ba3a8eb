"""The serving engine of one replica: a base model, LoRA adapters loaded on first use into an LRU
of `cache_size`, and the transformers sampler of `workbench.policy`.

    engine = open_transformers_replica(ServeSettings(model="tiny", adapters="s3://b/wb"))
    generate(engine, parse_request(body, 16, 256))      # an OpenAI chat.completion dict

`model` in a request is the base id (the base alone) or `<base>:<adapter>`; `<base>:default` is
the registry's serving default (re-read every `default_ttl_s`). An adapter is downloaded from
`<adapters>/adapters/<name>/` once per upload into the replica's cache folder, checked (config,
weights readable, trained on this base's weights hash) before it touches the model, loaded as a
named PEFT adapter, and evicted (deleted from the model) when the LRU is full. Requests on a
replica run one at a time under a lock (the model is shared), rendering included; each gets its
own torch Generator. The limits of `workbench.serve.limits` apply (context, image pixels, time).

With `engine="vllm"` (GPU) a replica holds one vLLM async engine instead and concurrent requests
batch in it (`workbench.serve.vllm_async`); the adapter contract and the counters stay the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench import registry, storage
from workbench.engines import ENGINES
from workbench.model import LoadedModel, LoraSettings, add_lora, load_model, weights_hash
from workbench.policy import ChatFormat, Completion, SamplingParams, Stream, chat_format
from workbench.policy.engine import DeadlineExceeded, context_len, model_max_len
from workbench.sampler.batch import OnStep, sample
from workbench.serve.chat import ChatRequest, completion_json, render_messages
from workbench.serve.errors import RequestError, shown
from workbench.serve.limits import (
    PromptLimits,
    TextBound,
    held,
    text_bound,
    timeout_error,
)
from workbench.serve.stream import Finish, Start, Token


@dataclass(frozen=True)
class ServeSettings:
    """What every replica serves and how (sent as is to each Ray Serve replica)."""

    model: str = "tiny"  # base model: "tiny", a checkpoint folder or a hub id
    served_name: str = ""  # the base id clients name ("" = model)
    adapters: str = ""  # store holding adapters/<name>/ (a folder or s3://bucket/prefix)
    endpoint_url: str = ""  # S3-compatible endpoint ("" = AWS_ENDPOINT_URL or AWS)
    cache_size: int = 4  # adapters resident per replica (LRU); Ray Serve LLM: per replica too
    cache_dir: str = ""  # downloaded adapters ("" = $WORKBENCH_CACHE/serve-adapters)
    num_replicas: int = 1  # Ray Serve replicas
    cpus_per_replica: float = 1.0  # Ray CPUs reserved by each replica
    host: str = "127.0.0.1"  # HTTP bind address of Ray Serve's proxy
    port: int = 8000  # HTTP port
    api_key_sha256: str = ""  # sha256 of the API key ("" = no key); the key itself never travels
    default_max_tokens: int = 16  # reply cap when a request names none
    max_tokens_limit: int = 256  # largest max_tokens a request may ask
    dtype: str = "float32"  # weights dtype (vllm: the dtype the base is hashed in; it runs bf16)
    device: str = "cpu"  # cpu | cuda: where the transformers engine runs (vllm: always CUDA)
    default_ttl_s: float = 5.0  # how long a replica trusts its copy of serving.json
    engine: str = "transformers"  # engines.ENGINES: transformers (a lock) | vllm (GPU, batching)
    gpu_memory_utilization: float = 0.5  # vllm: its share of the GPU's memory
    kv_cache_gb: float = 0.0  # vllm: its KV cache in GiB, set directly (0: what the share leaves)
    max_model_len: int = 0  # context in tokens, prompt + max_tokens (0: the model's, <= 16384)
    max_images: int = 16  # vllm: images one request may hold (it makes room for them)
    max_body_bytes: int = 8 * 2**20  # request body; past it 413 (Content-Length or bytes read)
    body_timeout_s: float = 30.0  # the whole body must arrive by then; past it 408, closed
    max_image_pixels: int = 4096 * 4096  # pixels of one request's images together (headers)
    max_queue: int = 64  # requests a replica holds at once, running or waiting; past it 429
    request_timeout_s: float = 60.0  # admission to reply: waiting + generating; past it 504

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"serve engine {self.engine!r} is not one of "
                             f"{', '.join(map(repr, ENGINES))}")
        for name in ("max_body_bytes", "body_timeout_s", "max_image_pixels", "max_queue",
                     "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"serve {name} must be positive, not {getattr(self, name)!r}")

    @property
    def base_id(self) -> str:
        """The model id of the base, as clients write it."""
        return self.served_name or self.model

    @property
    def gpus_per_replica(self) -> float:
        """GPUs Ray Serve reserves for each replica: one for vllm or a CUDA device, else none."""
        return 1.0 if self.engine == "vllm" or self.device.startswith("cuda") else 0.0


def key_hash(api_key: str) -> str:
    """sha256 hex of an API key ("" stays "": no key)."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


@dataclass
class Replica:
    """A replica's state: model, adapters resident in it (LRU, oldest first), counters."""

    settings: ServeSettings
    lm: LoadedModel  # lm.model: a PeftModel over the base (adapters named by peft_name); vllm: None
    fmt: ChatFormat
    base_hash: str  # weights sha256 of the base (adapters trained on another base are refused)
    store: storage.Store | None  # where adapters are published (None: base only)
    max_len: int  # the context served, in tokens: prompt + max_tokens (policy.engine.context_len)
    bound: TextBound | None  # tokens of a text before it is tokenized (limits.text_bound)
    # name -> peft name (transformers) or vLLM LoRARequest (vllm), least recently used first
    resident: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("requests", "hits", "misses", "loads", "evictions", "fetches", "load_failures"), 0))
    lock: threading.Lock = field(default_factory=threading.Lock)
    default_seen: tuple[float, str | None] = (0.0, None)  # (when read, serving default)
    backend: Any = None  # vllm: its VLLMBackend (async engine, LoRA ids); transformers: None


def open_transformers_replica(settings: ServeSettings) -> Replica:
    """Load and hash the base; wrap it in PEFT with an inert rank-1 adapter, so that adapters
    come and go with load_adapter / delete_adapter and the base runs with adapters disabled."""
    lm = load_model(settings.model, dtype=getattr(torch, settings.dtype), device=settings.device)
    base_hash = weights_hash(lm.model)
    max_len = context_len(settings.max_model_len, model_max_len(lm.model.config))
    lm.model = add_lora(lm.model, LoraSettings(rank=1, alpha=1)).eval()  # B = 0: inert
    return Replica(settings, lm, chat_format(lm.processor), base_hash, open_adapter_store(settings),
                  max_len, text_bound(lm.processor.tokenizer))


def prompt_limits(engine: Replica, request: ChatRequest) -> PromptLimits:
    """What the request's prompt may hold on this engine."""
    return PromptLimits(engine.max_len, request.max_tokens, engine.settings.max_image_pixels,
                        engine.bound)


def open_adapter_store(settings: ServeSettings) -> storage.Store | None:
    """The adapter store (None: base only), after emptying this replica's cache folder (a reused
    pid's old copies)."""
    shutil.rmtree(replica_cache(settings), ignore_errors=True)
    if not settings.adapters:
        return None
    return storage.open_store(settings.adapters, settings.endpoint_url)


def close_engine(engine: Replica) -> None:
    """Stop what the engine started (vllm: its engine process; transformers: nothing)."""
    if engine.backend is not None:
        engine.backend.llm.shutdown()


def peft_name(name: str) -> str:
    """A PEFT-safe adapter name (PEFT keys modules by it; '.' is not allowed there)."""
    return "a" + hashlib.sha1(name.encode()).hexdigest()[:16]


def _not_found(engine: Replica, model: str, why: str) -> RequestError:
    model = model if len(model) <= 100 else f"{model[:100]}... ({len(model):,} characters)"
    return RequestError(f"The model '{model}' does not exist: {why}. Available models: "
                        f"{', '.join(m['id'] for m in list_models(engine)['data'])}",
                        status=404, code="model_not_found")


def resolve_model(engine: Replica, model: str) -> str | None:
    """None for the base id, else the adapter name of `<base>:<adapter>` (404 otherwise)."""
    base = engine.settings.base_id
    if model == base:
        return None
    if not model.startswith(base + ":"):
        raise _not_found(engine, model, f"this server serves '{base}' and '{base}:<adapter>'")
    name = model[len(base) + 1:]
    if name == "default":
        default = serving_default(engine)
        if default is None:
            raise _not_found(engine, model, "no adapter has been promoted as the default")
        name = default
    if not registry.NAME_RE.match(name):
        raise _not_found(engine, model, f"{shown(name)} is not a valid adapter name")
    return name


def serving_default(engine: Replica) -> str | None:
    """The registry's serving default, re-read once `default_ttl_s` has passed."""
    seen_at, name = engine.default_seen
    if engine.store is None:
        return None
    if time.monotonic() - seen_at > engine.settings.default_ttl_s:
        name = registry.serving_state(engine.store)["default"]
        engine.default_seen = (time.monotonic(), name)
    return name


def fetch(engine: Replica, model: str, name: str) -> Path:
    """Local folder of adapter `name` (downloaded once per upload); 404 when unknown, 422 when
    its upload is torn."""
    if engine.store is None:
        raise _not_found(engine, model, "this server has no adapter store (start it with "
                                        "--adapters s3://... or a folder)")
    key = f"{registry.ADAPTERS}/{name}"
    if not storage.list_dir(engine.store, key):
        raise _not_found(engine, model, f"no adapter {name!r} in "
                                        f"{storage.redact(storage.url(engine.store, key))}")
    if not storage.folder_complete(engine.store, key):
        raise RequestError(f"adapter {name!r} is incomplete (its upload has no COMPLETE "
                           "marker): publish it again", status=422, code="adapter_incomplete")
    engine.counters["fetches"] += 1  # downloaded unless this upload is in the cache folder
    return storage.cached_folder(engine.store, key, replica_cache(engine.settings))


def replica_cache(settings: ServeSettings) -> Path:
    """This replica's folder of downloaded adapters (replicas never share one, so one never
    replaces a folder another is reading): <cache_dir or $WORKBENCH_CACHE/serve-adapters>/
    <host>-<pid>."""
    from workbench.model.tiny import cache_root

    root = Path(settings.cache_dir) if settings.cache_dir else cache_root() / "serve-adapters"
    return root / f"{socket.gethostname()}-{os.getpid()}"


def check_adapter(engine: Replica, name: str, folder: Path) -> None:
    """Refuse a broken adapter (unreadable config or weights) or one of another base (422),
    before it touches the model."""
    from safetensors.torch import load_file

    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        if config.get("peft_type") != "LORA" or "r" not in config:
            raise ValueError("adapter_config.json is not a LoRA config")
        weights = load_file(str(folder / "adapter_model.safetensors"))
        if not weights or not all("lora_" in key for key in weights):
            raise ValueError("adapter_model.safetensors holds no LoRA weights")
    except Exception as err:
        raise RequestError(f"adapter {name!r} is broken and was not loaded: "
                           f"{type(err).__name__}: {str(err)[:200]}", status=422,
                           code="adapter_broken") from None
    try:
        registry.check_base(registry.read_adapter_meta(folder), engine.base_hash,
                            engine.settings.base_id, repr(name))
    except registry.ForeignBaseError as err:
        raise RequestError(str(err), status=422, code="adapter_foreign_base") from None


def lru_hit(engine: Replica, name: str) -> bool:
    """Whether adapter `name` is resident (a hit: it becomes the most recent); counts hit/miss."""
    if name in engine.resident:
        engine.counters["hits"] += 1
        engine.resident.move_to_end(name)
        return True
    engine.counters["misses"] += 1
    return False


def ensure_adapter(engine: Replica, model: str, name: str) -> str:
    """The PEFT name of adapter `name`, loading it (and evicting the least recently used one
    beyond cache_size) on a miss."""
    if lru_hit(engine, name):
        return engine.resident[name]
    folder = fetch(engine, model, name)
    check_adapter(engine, name, folder)
    internal, peft_model = peft_name(name), engine.lm.model
    try:
        peft_model.load_adapter(str(folder), adapter_name=internal)
    except Exception as err:
        engine.counters["load_failures"] += 1
        if internal in peft_model.peft_config:
            peft_model.delete_adapter(internal)
        raise RequestError(f"adapter {name!r} could not be loaded onto the base: "
                           f"{type(err).__name__}: {str(err)[:200]}", status=422,
                           code="adapter_broken") from None
    engine.resident[name] = internal
    engine.counters["loads"] += 1
    while len(engine.resident) > engine.settings.cache_size:
        _, old = engine.resident.popitem(last=False)
        peft_model.set_adapter(internal)  # never delete the active adapter
        peft_model.delete_adapter(old)
        engine.counters["evictions"] += 1
    return internal


def generate(engine: Replica, request: ChatRequest,
             deadline: float = float("inf")) -> dict[str, Any]:
    """Answer one chat request (an OpenAI chat.completion dict); RequestError for 4xx, and 504
    once time.monotonic() passes `deadline` (waiting for the engine, or between decode steps).
    The prompt is rendered under the engine's lock too: one request's images at a time."""
    with held(engine.lock, deadline, engine.settings.request_timeout_s, "the engine"):
        stream, internal = _prepare(engine, request)
        completions = _sample(engine, request, internal, stream, deadline)
    return completion_json(request, engine.lm.processor, len(stream), completions)


def answer_stream(engine: Replica, request: ChatRequest, deadline: float,
                  put: Callable[[Any], None]) -> None:
    """Answer a streamed chat request (`serve.stream`): put(Start) once the prompt is rendered,
    a Token per decode step and choice, a Finish per choice. Under the engine's lock, as
    `generate`; StreamClosed from `put` (the client left) stops the decode at that step."""
    with held(engine.lock, deadline, engine.settings.request_timeout_s, "the engine"):
        stream, internal = _prepare(engine, request)
        put(Start(len(stream)))

        def on_step(rows: list[int], tokens: list[int], logprobs: list[float]) -> None:
            for index, token, logprob in zip(rows, tokens, logprobs):
                put(Token(index, token, logprob))

        completions = _sample(engine, request, internal, stream, deadline, on_step)
    for index, completion in enumerate(completions):
        put(Finish(index, completion.stop_reason))


def _prepare(engine: Replica, request: ChatRequest) -> tuple[Stream, str | None]:
    """A request under the engine's lock: counted, its model resolved, its prompt rendered and
    its adapter loaded (the stream, and the adapter's name in the model or None: the base)."""
    engine.counters["requests"] += 1
    adapter = resolve_model(engine, request.model)
    stream = render_messages(engine.lm.processor, engine.fmt, request.messages,
                             prompt_limits(engine, request))
    return stream, None if adapter is None else ensure_adapter(engine, request.model, adapter)


def _sample(engine: Replica, request: ChatRequest, internal: str | None, stream: Stream,
            deadline: float, on_step: OnStep | None = None) -> list[Completion]:
    """The request's n completions of `stream` from the base or the loaded adapter `internal`
    (`ensure_adapter`; the lock held)."""
    seed = request.seed if request.seed is not None else int.from_bytes(os.urandom(4), "little")
    params = SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature)
    model = engine.lm.model
    if internal is not None:
        model.set_adapter(internal)
    try:
        with model.disable_adapter() if internal is None else nullcontext():
            return sample(model, engine.fmt, [stream], request.n, params,
                          torch.Generator().manual_seed(seed),
                          engine.lm.processor.tokenizer.pad_token_id, deadline, on_step)[0]
    except DeadlineExceeded as stop:
        raise timeout_error(engine.settings.request_timeout_s, f"after {stop.tokens} of "
                            f"{request.max_tokens} reply tokens") from None


def list_models(engine: Replica) -> dict[str, Any]:
    """/v1/models: the base, `<base>:<name>` for every complete published adapter, and
    `<base>:default` when one is promoted."""
    base = engine.settings.base_id
    data = [{"id": base, "object": "model", "created": 0, "owned_by": "workbench",
             "root": engine.settings.model, "parent": None}]
    if engine.store is not None:
        names = registry.list_names(engine.store)
        names += ["default"] if registry.serving_state(engine.store)["default"] else []
        data += [{"id": f"{base}:{n}", "object": "model", "created": 0,
                  "owned_by": "workbench", "root": n, "parent": base} for n in names]
    return {"object": "list", "data": data}


def engine_stats(engine: Replica) -> dict[str, Any]:
    """Counters of this replica: requests, adapter cache hits / misses (a miss is a load unless
    the adapter is refused) / loads / evictions, resident."""
    return {"replica": f"{socket.gethostname()}:{os.getpid()}", "base": engine.settings.base_id,
            "base_weights_sha256": engine.base_hash, "cache_size": engine.settings.cache_size,
            "resident": list(engine.resident), **engine.counters}
