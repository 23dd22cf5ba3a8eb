"""The vLLM backend of the workbench's own OpenAI-compatible app (`ServeSettings.engine="vllm"`,
GPU only): each replica holds ONE vLLM async engine (`vllm.AsyncLLMEngine`, v1's AsyncLLM) and the
chat route awaits it, so concurrent requests batch inside vLLM (continuous batching) instead of
queueing behind the transformers engine's lock.

    python -m workbench serve --engine vllm --adapters runs/store --gpu-memory-utilization 0.5
    serve(model, adapters="runs/store", engine="vllm", address="")      # from a notebook

The same as the transformers engine: the chat rendering (`serve.chat.render_messages`), the
adapter contract (fetched once per upload into the replica's cache folder, then checked: config,
weights, base-weights hash), 404 / 422 errors and the replica's LRU counters (/v1/stats).
What differs:
- the base is loaded once on the CPU in `settings.dtype`, only to hash its weights (an adapter
  records the hash of the base in the dtype it was trained in) and to read its context length;
  vLLM then runs it in bfloat16 (its LoRA kernels take bf16 / fp16 only);
- the engine: enable_lora with max_loras = max_cpu_loras = cache_size, max_lora_rank from the
  largest rank published when the replica starts (at least 8; a larger adapter published later
  is refused with a 422), prefix caching, max_model_len = the model's max_position_embeddings;
- an adapter with LoRA on the vision tower (`lora.vision=true`) is refused with a 422 naming
  its modules (`check_vision`): vLLM applies LoRA to Qwen3-VL's language model only;
- a checked adapter goes with each request as LoRARequest(name, id, folder); the id is stable per
  upload (a re-published name gets a new id, so vLLM never keeps old weights under it). Our LRU
  counts hits / misses / evictions as the transformers engine does; vLLM keeps the same number of
  adapters loaded and evicts by its own LRU (it knows which ones running requests still use);
- each of the n choices is one vLLM request: the stream's tokens (an image's run of pads cut to
  one) and its PIL images (`vllm.engine.vllm_prompt`), its own seed drawn from the
  request's seed; vLLM's expanded prompt must equal our tokens (`check_prompt`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from workbench import registry, storage
from workbench.model import load_model, weights_hash
from workbench.policy import SamplingParams, Stream, chat_format
from workbench.policy.engine import EngineSettings, model_max_len
from workbench.serve.chat import ChatRequest, completion_json, render_messages
from workbench.serve.engine import (
    Replica,
    ServeSettings,
    check_adapter,
    fetch,
    lru_hit,
    open_adapter_store,
    prompt_limits,
    resolve_model,
)
from workbench.serve.errors import RequestError
from workbench.serve.limits import held, remaining_s, text_bound, timeout_error
from workbench.serve.stream import Finish, Start, Token
from workbench.vllm.args import checked_max_len, engine_kwargs, import_vllm
from workbench.vllm.engine import (
    check_prompt,
    row_seeds,
    sampling_params,
    to_completion,
    token_logprob,
    vllm_prompt,
)

MIN_LORA_RANK = 8  # the engine's LoRA slots hold at least this rank (adapters published later)
VLLM_DTYPE = "bfloat16"  # what vLLM runs the base in (its LoRA kernels: bf16 or fp16)


@dataclass
class VLLMBackend:
    """A replica's vLLM side: the async engine and what its requests are sent with."""

    vllm: ModuleType  # the vllm package (SamplingParams)
    llm: Any  # vllm.AsyncLLMEngine: generate(prompt, params, request_id, lora_request=...)
    lora_cls: Any  # vllm.lora.request.LoRARequest
    max_rank: int  # the engine's max_lora_rank: an adapter of a larger rank is refused
    lora_ids: dict[tuple[str, str], int] = field(default_factory=dict)  # (name, upload) -> id


def published_rank(store: storage.Store | None) -> int:
    """The largest LoRA rank `r` among the store's published adapters (0: none readable; a
    broken adapter is refused when it is asked for, not here)."""
    if store is None:
        return 0
    ranks = [0]
    for name in registry.list_names(store):
        try:
            config = storage.read_json(store, f"{registry.ADAPTERS}/{name}/adapter_config.json")
            ranks.append(int(config["r"]))
        except (storage.StorageError, ValueError, KeyError, TypeError):
            continue
    return max(ranks)


def engine_args(settings: ServeSettings, model_path: str, lora_rank: int,
                max_len: int) -> dict[str, Any]:
    """Keyword arguments of vllm.AsyncEngineArgs for a replica serving `model_path`: the
    sampler's (`vllm.args.engine_kwargs`, adapters as LoRA requests) with one LoRA slot per
    cached adapter and vLLM's stats off."""
    engine = EngineSettings("vllm", gpu_memory_utilization=settings.gpu_memory_utilization,
                            max_images=settings.max_images, vllm_kv_cache_gb=settings.kv_cache_gb)
    kwargs = engine_kwargs(model_path, engine, max(lora_rank, MIN_LORA_RANK), VLLM_DTYPE, max_len)
    return kwargs | {"max_loras": settings.cache_size, "max_cpu_loras": settings.cache_size,
                     "disable_log_stats": True}


def open_vllm_replica(settings: ServeSettings) -> Replica:
    """Hash the base on the CPU (then drop its weights), and start vLLM's async engine on it."""
    from workbench.model.presets import SHAPES

    vllm = import_vllm("serve engine='vllm'", "serve with engine='transformers'")
    if settings.model in SHAPES:
        raise ValueError(f"engine='vllm' loads the base from a checkpoint folder, and "
                         f"{settings.model!r} is a shape built in memory: save it first "
                         "(model.save_pretrained + processor.save_pretrained)")
    lm = load_model(settings.model, dtype=getattr(torch, settings.dtype), device="cpu")
    base_hash = weights_hash(lm.model)
    length = checked_max_len(EngineSettings("vllm", max_model_len=settings.max_model_len),
                             VLLM_DTYPE, model_max_len(lm.model.config))
    lm.model = None  # vLLM holds the weights; the processor renders the requests
    store = open_adapter_store(settings)
    args = engine_args(settings, lm.path, published_rank(store), length)
    llm = vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(**args))
    backend = VLLMBackend(vllm, llm, importlib.import_module("vllm.lora.request").LoRARequest,
                          args["max_lora_rank"])
    return Replica(settings, lm, chat_format(lm.processor), base_hash, store, length,
                  text_bound(lm.processor.tokenizer), backend=backend)


def check_rank(backend: VLLMBackend, name: str, folder: Path) -> None:
    """Refuse (422) an adapter whose rank is above the engine's max_lora_rank."""
    rank = int(json.loads((folder / "adapter_config.json").read_text())["r"])
    if rank > backend.max_rank:
        raise RequestError(f"adapter {name!r} has LoRA rank {rank}, above this server's "
                           f"max_lora_rank {backend.max_rank} (set from the adapters published "
                           "when it started): restart the server to serve it", status=422,
                           code="adapter_rank")


def vision_modules(folder: Path) -> list[str]:
    """The vision-tower modules (`visual.`...) an adapter folder's LoRA weights adapt, sorted
    (read from the safetensors header: no tensor is loaded)."""
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as weights:
        keys = list(weights.keys())
    return sorted({key[key.index("visual."):].split(".lora_")[0] for key in keys
                   if key.startswith("visual.") or ".visual." in key})


def check_vision(name: str, folder: Path) -> None:
    """Refuse (422) an adapter with LoRA on the vision tower: vLLM applies LoRA to Qwen3-VL's
    language model only, so it would serve the adapter without those modules."""
    modules = vision_modules(folder)
    if modules:
        listed = ", ".join(modules[:3]) + (f", ... ({len(modules)} in all)"
                                           if len(modules) > 3 else "")
        raise RequestError(f"adapter {name!r} has LoRA on vision-tower modules ({listed}) that "
                           "vLLM does not apply on Qwen3-VL: train it with lora.vision=false, "
                           "or serve it with engine='transformers'", status=422,
                           code="adapter_vision_lora")


def adapter_lora(engine: Replica, model: str, name: str) -> Any:
    """The LoRARequest of adapter `name`: on a miss it is fetched, checked and given the id of
    its upload; beyond cache_size the least recently used one is evicted (counted)."""
    backend = engine.backend
    if lru_hit(engine, name):
        return engine.resident[name]
    folder = fetch(engine, model, name)
    check_adapter(engine, name, folder)
    check_rank(backend, name, folder)
    check_vision(name, folder)
    assert engine.store is not None  # fetch found the adapter there
    upload = storage.marker_token(engine.store, f"{registry.ADAPTERS}/{name}")
    lora_id = backend.lora_ids.setdefault((name, upload), len(backend.lora_ids) + 1)
    engine.resident[name] = backend.lora_cls(lora_name=name, lora_int_id=lora_id,
                                             lora_path=str(folder))
    engine.counters["loads"] += 1
    while len(engine.resident) > engine.settings.cache_size:
        engine.resident.popitem(last=False)
        engine.counters["evictions"] += 1
    return engine.resident[name]


def check_images(engine: Replica, stream: Stream) -> None:
    """Refuse (400) a request vLLM would: more images than it makes room for (the context and
    the pixels are checked by the app and as the prompt is rendered, as for transformers)."""
    limit = engine.settings.max_images
    if len(stream.images) > limit:
        raise RequestError(f"the request holds {len(stream.images)} images: this server takes "
                           f"at most {limit} (max_images)")


def prepare(engine: Replica, request: ChatRequest,
            deadline: float = float("inf")) -> tuple[Stream, dict[str, Any], Any]:
    """The request's stream, its vLLM prompt and LoRARequest (None: the base); the lock is held
    only while the adapter LRU is read and changed. RequestError for 4xx (504 past deadline)."""
    stream = render_messages(engine.lm.processor, engine.fmt, request.messages,
                             prompt_limits(engine, request))
    check_images(engine, stream)
    with held(engine.lock, deadline, engine.settings.request_timeout_s, "the adapter cache"):
        engine.counters["requests"] += 1
        adapter = resolve_model(engine, request.model)
        lora = None if adapter is None else adapter_lora(engine, request.model, adapter)
    return stream, vllm_prompt(stream), lora


async def all_or_none(coroutines: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Await the choices' requests together; the first that fails cancels the others (vLLM's
    generate aborts a cancelled request), and its error is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def final_output(llm: Any, prompt: dict[str, Any], params: Any, lora: Any) -> Any:
    """The finished RequestOutput of one vLLM request (the last its stream yields)."""
    last = None
    async for out in llm.generate(prompt, params, uuid.uuid4().hex, lora_request=lora):
        last = out
    return last


async def generate_vllm(engine: Replica, request: ChatRequest,
                        deadline: float = float("inf")) -> dict[str, Any]:
    """Answer one chat request through vLLM (an OpenAI chat.completion dict): rendering and the
    adapter run in a worker thread, the n choices are awaited together with everything else in
    flight. RequestError for 4xx; 504 once time.monotonic() passes `deadline` (the awaited
    requests are cancelled, and vLLM's generate aborts a cancelled request)."""
    stream, prompt, lora = await asyncio.to_thread(prepare, engine, request, deadline)
    backend: VLLMBackend = engine.backend
    params_N = choice_params(engine, request)
    try:
        outputs_N = await asyncio.wait_for(all_or_none(
            [final_output(backend.llm, prompt, p, lora) for p in params_N]),
            timeout=None if deadline == float("inf") else remaining_s(deadline))
    except TimeoutError:
        raise timeout_error(engine.settings.request_timeout_s, "generating") from None
    for out in outputs_N:
        check_prompt(out.prompt_token_ids, stream)
    completions = [to_completion(out.outputs[0], engine.fmt) for out in outputs_N]
    return completion_json(request, engine.lm.processor, len(stream), completions)


def choice_params(engine: Replica, request: ChatRequest) -> list[Any]:
    """vllm.SamplingParams of each of the request's n choices, seeds drawn from its seed."""
    params = SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature)
    generator = None if request.seed is None else torch.Generator().manual_seed(request.seed)
    return [sampling_params(engine.backend.vllm, params, engine.fmt, seed)
            for seed in row_seeds(request.n, generator)]


async def answer_stream_vllm(engine: Replica, request: ChatRequest, deadline: float,
                             put: Callable[[Any], None]) -> None:
    """Answer a streamed chat request through vLLM (`serve.stream`): put(Start) once the prompt
    is rendered, a Token as each choice's output grows, a Finish per choice. Cancelled (the
    client left, or past the deadline): vLLM aborts the choices' requests."""
    stream, prompt, lora = await asyncio.to_thread(prepare, engine, request, deadline)
    put(Start(len(stream)))
    await all_or_none([stream_choice(engine, prompt, params, lora, stream, index, put)
                       for index, params in enumerate(choice_params(engine, request))])


async def stream_choice(engine: Replica, prompt: dict[str, Any], params: Any, lora: Any,
                        stream: Stream, index: int, put: Callable[[Any], None]) -> None:
    """One choice's vLLM request, its new tokens put as they come (vLLM's outputs are
    cumulative), then its Finish."""
    sent, last = 0, None
    async for out in engine.backend.llm.generate(prompt, params, uuid.uuid4().hex,
                                                 lora_request=lora):
        output = out.outputs[0]
        for k in range(sent, len(output.token_ids)):
            put(Token(index, output.token_ids[k], token_logprob(output, k)))
        sent, last = len(output.token_ids), out
    assert last is not None, "vLLM answered nothing"
    check_prompt(last.prompt_token_ids, stream)
    put(Finish(index, to_completion(last.outputs[0], engine.fmt).stop_reason))
