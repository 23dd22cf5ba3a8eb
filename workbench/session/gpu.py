"""GPU settings of an in-process model host (the seed's 8B shape on one GPU).

All off by default and unchanged on the CPU; `configure_gpu(host)` switches on what the field uses
for a colocated trainer + sampler on one GPU:

- sampler: grouped-query decode attention that reads the KV cache once (`policy.attention`), a KV
  pool sized for the rollout and decode steps replayed as CUDA graphs (`policy.graphs`), through
  a merged, fused copy of the text weights (`policy.fused`), optionally torch.compile'd;
- trainer: gradient checkpointing (activations of one layer at a time, recomputed in backward),
  the lm_head only on the loss tokens (`ModelHost.loss_tokens_only`) and the LoRA adapters in
  bf16 under autocast (`ModelHost.lora_autocast`).

    host = make_host("qwen3-vl-8b-shape", LoraSettings(32, 64), dtype=torch.bfloat16,
                     device="cuda", hash_weights=False)
    configure_gpu(host, kv_rows=64, kv_tokens=2048)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _keep_matmuls(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing policy: keep the outputs of the base model's matmuls and of
    attention; recompute everything else (norms, rotary, SiLU, casts, LoRA's rank-r products)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    if func in (aten._scaled_dot_product_efficient_attention.default,
                aten._scaled_dot_product_flash_attention.default,
                aten._scaled_dot_product_cudnn_attention.default,
                aten._scaled_dot_product_flash_attention_for_cpu.default):
        return CheckpointPolicy.MUST_SAVE
    if func in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        left = args[1] if func is aten.addmm.default else args[0]
        if left.shape[-1] > 64:  # not LoRA's B (inner dimension = rank): cheap to recompute
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def keep_matmuls_context() -> tuple[Any, Any]:
    """`context_fn` for torch.utils.checkpoint: the `_keep_matmuls` policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_matmuls)


def set_checkpointing(model: Any, on: bool, selective: bool = False) -> None:
    """Gradient checkpointing of each decoder layer: off; full (recompute the layer's forward in
    backward); or selective (keep matmul and attention outputs, recompute the elementwise ops:
    most of full checkpointing's memory saving for a small part of its recompute)."""
    if not on:
        model.gradient_checkpointing_disable()
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = keep_matmuls_context
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_for_training(model: Any) -> None:
    """torch.compile each text decoder layer for the update (grad enabled): inductor fuses the
    elementwise work around the matmuls (fp32 RMSNorms, rotary, SiLU x up, residuals, the LoRA
    epilogue) forward and backward, and its partitioner recomputes cheap ops instead of saving
    them. Calls without grad (the sampler's prefill, `forward`) stay eager. Shapes are dynamic:
    one compilation serves every layer and sequence length. Idempotent."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.language_model.layers:
        if getattr(layer, "compiled_for_training", False):
            continue
        eager = layer.forward
        compiled = torch.compile(eager, dynamic=True)

        def forward(*args: Any, _eager: Any = eager, _compiled: Any = compiled,
                    **kwargs: Any) -> Any:
            return (_compiled if torch.is_grad_enabled() else _eager)(*args, **kwargs)

        layer.forward = forward
        layer.compiled_for_training = True


@dataclass(frozen=True)
class GpuSettings:
    """Speed settings of a GPU host (each can be switched off to measure what it brings)."""

    gqa_decode: bool = True  # one-token steps read each KV head once
    cuda_graphs: bool = True  # pooled KV + graph-replayed decode steps (eager static steps if off)
    kv_rows: int = 64  # rows the KV pool is sized for (P x G of a rollout)
    kv_tokens: int = 2048  # tokens per row the KV pool is sized for (grown if exceeded)
    bucket: int = 256  # decode attention window granularity (one graph per bucket)
    fused_decode: bool = True  # decode through merged LoRA + fused projections (policy.fused)
    compile_decode: bool = False  # torch.compile the fused layer step before capture
    gradient_checkpointing: bool = True  # recompute each layer's activations in backward
    selective_checkpointing: bool = False  # ... only its elementwise ops (keep matmul outputs)
    compile_layers: bool = False  # torch.compile the decoder layers for the update
    loss_tokens_only: bool = True  # lm_head only where the loss weight is non-zero
    lora_autocast: bool = True  # adapters in bf16 under autocast in forward(_backward)


def configure_gpu(host: Any, settings: GpuSettings = GpuSettings()) -> Any:
    """Apply `settings` to `host` (a session.inprocess.ModelHost); returns the StaticDecode or
    None. Call it before the first rollout."""
    from workbench.policy.attention import use_gqa_decode_attention
    from workbench.policy.graphs import GraphEngine, make_static_decode

    model = host.lm.model
    if settings.gqa_decode:
        use_gqa_decode_attention(model)
    if settings.gradient_checkpointing:
        set_checkpointing(model, True, settings.selective_checkpointing)
    if settings.compile_layers:
        compile_for_training(model)
    host.loss_tokens_only = settings.loss_tokens_only
    host.lora_autocast = settings.lora_autocast
    static = make_static_decode(model, settings.kv_rows, settings.kv_tokens, settings.bucket,
                                use_graphs=settings.cuda_graphs and model.device.type == "cuda",
                                fused=settings.fused_decode, compiled=settings.compile_decode)
    host.engine = GraphEngine(host.lm, static)
    return static


@dataclass(frozen=True)
class SpeedSettings:
    """What a run's config switches on (its keys in brackets); see `apply_speed`."""

    gradient_checkpointing: bool = False  # trainer.gradient_checkpointing
    loss_tokens_only: bool = False  # trainer.loss_tokens_only
    cuda_graphs: bool = False  # generator.cuda_graphs, on a CUDA device with our sampler
    kv_rows: int = 64  # rows of a rollout (P x G): the KV pool's size
    lora_autocast: bool = False  # trainer.lora_autocast
    selective_checkpointing: bool = False  # trainer.selective_checkpointing
    compile_layers: bool = False  # trainer.compile_layers
    fused_decode: bool = True  # generator.fused_decode (with cuda_graphs)
    compile_decode: bool = False  # generator.compile_decode (with fused_decode)


def apply_speed(host: Any, speed: SpeedSettings, trainer: bool = True,
                sampler: bool = True) -> None:
    """The trainer switches and/or the sampler's CUDA-graph decode on a host: both in-process,
    one side in a Ray trainer worker or sampler engine (no KV pool where nothing samples)."""
    model = host.lm.model
    if sampler and speed.cuda_graphs and model.device.type == "cuda":
        configure_gpu(host, GpuSettings(kv_rows=speed.kv_rows, gradient_checkpointing=False,
                                        loss_tokens_only=host.loss_tokens_only,
                                        lora_autocast=host.lora_autocast,
                                        fused_decode=speed.fused_decode,
                                        compile_decode=speed.compile_decode))
    if trainer:
        host.loss_tokens_only = speed.loss_tokens_only
        host.lora_autocast = speed.lora_autocast
        if speed.gradient_checkpointing:
            set_checkpointing(model, True, speed.selective_checkpointing)
        if speed.compile_layers:
            compile_for_training(model)
