"""vLLM sampling with the LoRA adapter merged into vLLM's weights (`engine.vllm_lora=merged`).

With `adapter` (the default) vLLM runs its LoRA kernels beside every projection, and each weights
version reaches it as a PEFT folder. With `merged`, vLLM is built without LoRA, and each weights
version is pushed into its copy of the text weights as W + scale * B @ A: the same projections
the base model runs, no LoRA kernels in the decode or prefill. On one H200 at the 8B shape that
is vLLM's own loop without its LoRA cost (benchmarks/RESULTS.md, "The sampler").

How a version travels (same GPU):
1. `merged_weights(model, tensors)`: for every LoRA linear of the peft model, its HF checkpoint
   name and its weight merged with the version's snapshot `tensors` (model.lora.merged_weight:
   float32 sum, rounded once to bf16);
2. `share(chunk)`: each tensor as a CUDA IPC handle (CPU tensors travel by value), when vLLM's
   engine runs in its own process (vLLM's default); the tensors themselves when it runs in this
   one (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as in the Ray engine actors: its calls are not
   serialised, and CUDA IPC cannot open a handle in the process that made it);
3. `llm.collective_rpc("load_shared_weights", args=(payload,))`: `MergedWeightsWorker`, which
   vLLM mixes into its GPU worker (`worker_extension_cls`), opens the handles and calls the
   model's own `load_weights`, which copies them into vLLM's fused q/k/v and gate/up weights in
   place (its CUDA graphs keep their pointers). A model vLLM quantised (`engine.vllm_fp8`) is
   loaded between `begin_weights` and `end_weights`: vLLM's layerwise reload buffers each
   layer's bf16 weights and quantises the layer again once it has all of them, into the same
   storage;
4. `llm.reset_prefix_cache()`: KV cached under the old weights is never reused; and with a LoRA
   on the vision tower (`lora.vision`), vLLM's encoder cache too (the image features).
The merged tensors are made and sent a chunk of layers at a time, so the extra memory is one
chunk (`CHUNK_BYTES`), not a second copy of the model.

A version is merged when it is first sampled (`VLLMEngine.use_version`), from the host's snapshot
of its LoRA factors and the model's frozen base weights: never from the trainer's live LoRA, so an
in-process session can sample on its own thread while the trainer updates (`Session`'s sampler
lane). vLLM holds one merged version at a time: sampling an older version (an old SamplingClient)
merges it again from its snapshot.

On Ray, a vLLM engine actor colocated with a trainer worker holds no copy of the model: the
trainer merges each version from its own base and sends the chunks to the engine as CUDA IPC
handles (`cluster.workers.TrainerWorker.hand_version`), and the engine loads them with the same
`MergedLoad` (`VLLMEngine.load_merged`, `end_merged`).
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from workbench.model.lora import merged_weight

WORKER_EXTENSION = "workbench.vllm.merged.MergedWeightsWorker"
"""vllm.LLM(worker_extension_cls=...): the class vLLM mixes into its GPU worker."""

VISION_PREFIX = "model.visual."
"""HF names of the vision tower's weights: merged there, vLLM's cached image features go stale."""

CHUNK_BYTES = 1 << 30
"""Merged weights made and sent per collective_rpc call (about 2 decoder layers at 8B)."""


def hf_name(module_name: str) -> str:
    """The HF checkpoint name of a peft-wrapped linear's weight (what vLLM's load_weights takes):
    'base_model.model.model.language_model.layers.0.self_attn.q_proj' ->
    'model.language_model.layers.0.self_attn.q_proj.weight'."""
    return module_name.removeprefix("base_model.model.") + ".weight"


def lora_linears(model: Any) -> Iterator[tuple[str, Any]]:
    """(module name, module) for every linear that carries a LoRA adapter."""
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            yield name, module


def snapshot_factors(tensors: dict[str, torch.Tensor], name: str, module: Any
                     ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Adapter -> (A, B) of LoRA linear `name` in a snapshot of the trainable tensors (a
    sampler weights version: `session.host.snapshot`)."""
    return {a: (tensors[f"{name}.lora_A.{a}.weight"], tensors[f"{name}.lora_B.{a}.weight"])
            for a in module.lora_A}


def merged_weights(model: Any, tensors: dict[str, torch.Tensor],
                   chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The model's LoRA linears merged with a version's snapshot `tensors` (W + scale * B @ A,
    bf16), in chunks of about `chunk_bytes`: each chunk a list of (HF weight name, tensor), a
    linear's bias (the vision tower's) beside its weight, as it is. Only the frozen base weights
    are read from the model, so a trainer may update its LoRA meanwhile."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    with torch.no_grad():
        for name, module in lora_linears(model):
            weight = merged_weight(module, snapshot_factors(tensors, name, module))
            chunk.append((hf_name(name), weight))
            bias = module.base_layer.bias
            if bias is not None:  # unchanged, but vLLM's FP8 reload wants each layer whole
                chunk.append((hf_name(name).removesuffix(".weight") + ".bias", bias.detach()))
            size += weight.numel() * weight.element_size()
            if size >= chunk_bytes:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def share(chunk: list[tuple[str, torch.Tensor]]) -> bytes:
    """A chunk as bytes another process on the same GPU opens without a copy: CUDA tensors as
    IPC handles (torch.multiprocessing's), CPU tensors by value. The sender keeps the tensors
    alive until the receiver has loaded them."""
    from torch.multiprocessing.reductions import reduce_tensor

    items = []
    for name, tensor in chunk:
        if not tensor.is_contiguous():  # .contiguous() would share a copy freed on return
            raise ValueError(f"share: {name} is not contiguous")
        if tensor.is_cuda:
            items.append((name, "ipc", reduce_tensor(tensor)[1]))
        else:
            items.append((name, "value", tensor))
    return pickle.dumps((os.getpid(), items))


def engine_in_process() -> bool:
    """Whether vLLM runs its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip().lower() in ("0", "false")


def open_shared(payload: bytes, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The receiving side of `share`: (name, tensor) on `device`."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    sender, items = pickle.loads(payload)  # noqa: S301 - from our own process, same machine
    if sender == os.getpid() and any(kind == "ipc" for _, kind, _ in items):
        raise RuntimeError("CUDA IPC handles cannot be opened in the process that made them: "
                           "with vLLM's engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING="
                           "0), push_merged sends the tensors themselves")
    out = []
    for name, kind, data in items:
        if kind == "ipc":
            args = list(data)
            args[6] = device.index  # the device index inside this process
            out.append((name, rebuild_cuda_tensor(*args)))
        else:
            out.append((name, data.to(device)))
    return out


class MergedWeightsWorker:
    """Mixed into vLLM's GPU worker by `worker_extension_cls`: loads shared merged weights."""

    device: torch.device
    model_runner: Any

    def begin_weights(self) -> bool:
        """Before a version's chunks. A model vLLM quantised has its layers set back to their
        bf16 checkpoint form, each layer's weights buffered as they load and the layer quantised
        again once complete (vLLM's layerwise reload); an unquantised model loads in place.
        Returns whether the weights are reloaded that way."""
        if self.model_runner.model_config.quantization is None:
            return False
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())
        return True

    def end_weights(self) -> int:
        """After a version's chunks: a quantised model's reload finished. The layers a version
        does not carry (embeddings, norms, the vision tower without `lora.vision`) keep their
        weights; vLLM would log a warning for each of them on every version, so its reload's
        warnings are held back meanwhile, and the reload is checked here instead: returns how
        many layers were quantised again (0 for an unquantised model); RuntimeError when none
        was, or when a layer got only part of its weights."""
        if self.model_runner.model_config.quantization is None:
            return 0
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        model = self.model_runner.get_model()
        done, partial = reload_counts([get_layerwise_info(m) for m in model.modules()])
        log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            finalize_layerwise_reload(model, self.model_runner.model_config)
        finally:
            log.setLevel(level)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if partial or not done:
            raise RuntimeError(f"vLLM's FP8 reload quantised {done} layers again and left "
                               f"{partial} with only part of their weights: the version was "
                               "not loaded")
        return done

    def load_shared_weights(self, payload: bytes | list[tuple[str, torch.Tensor]]) -> int:
        """Load a chunk into the model's weights in place: `share`d bytes, or (engine in this
        process) the (name, tensor) list itself. Returns how many tensors."""
        weights = payload if isinstance(payload, list) else open_shared(payload, self.device)
        self.model_runner.get_model().load_weights(weights)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # copied before the sender frees its tensors
        return len(weights)


def reload_counts(infos: list[Any]) -> tuple[int, int]:
    """(layers done, layers part-loaded) from vLLM's layerwise-reload records of a model's
    modules: a layer that got all its weights was quantised again and its record reset (no
    longer loadable); one still loadable holds some of its weights or none."""
    done = sum(not info.can_load() for info in infos)
    partial = sum(info.can_load() and 0 < info.load_numel < (info.load_numel_total or 0)
                  for info in infos)
    return done, partial


class MergedLoad:
    """vLLM's side of one version's push: `begin_weights` on construction, then each chunk
    (`load`: `share`d bytes from another process on this GPU, or the tensors themselves from
    this one), then `finish`: `end_weights`, and vLLM's prefix cache (and, with the vision
    tower merged, its encoder cache) dropped, since their KV and features came from the old
    weights."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.loaded, self.vision = llm, 0, False
        llm.collective_rpc("begin_weights")

    def load(self, payload: bytes | list[tuple[str, torch.Tensor]], names: list[str]) -> int:
        """One chunk of the version, whose weight names are `names` -> tensors loaded."""
        self.vision = self.vision or any(name.startswith(VISION_PREFIX) for name in names)
        counts = self.llm.collective_rpc("load_shared_weights", args=(payload,))
        if any(n != len(names) for n in counts):
            raise RuntimeError(f"vLLM loaded {counts} of {len(names)} merged weights")
        self.loaded += len(names)
        return len(names)

    def finish(self) -> int:
        """The version complete -> the number of tensors loaded."""
        self.llm.collective_rpc("end_weights")
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after new weights "
                               "(requests still running?); its cached KV would be from the old "
                               "weights")
        if self.vision:
            self.llm.llm_engine.reset_encoder_cache()
        return self.loaded


def push_merged(llm: Any, model: Any, tensors: dict[str, torch.Tensor],
                chunk_bytes: int = CHUNK_BYTES) -> int:
    """Merge a version's snapshot `tensors` with the model's base weights into vLLM's weights,
    chunk by chunk (`MergedLoad`), from the process that holds the model. Returns the number of
    tensors loaded."""
    load, in_process = MergedLoad(llm), engine_in_process()
    for chunk in merged_weights(model, tensors, chunk_bytes):
        load.load(chunk if in_process else share(chunk), [name for name, _ in chunk])
        del chunk  # freed before the next chunk is merged: one chunk in memory
    return load.finish()
