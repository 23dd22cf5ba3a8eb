"""GPU settings of an in-process model host (the seed's 8B shape on one GPU).

All off by default and unchanged on the CPU; `configure_gpu(host)` switches on what the field uses
for a colocated trainer + sampler on one GPU:

- sampler: grouped-query decode attention that reads the KV cache once (`policy.attention`), a KV
  pool sized for the rollout and decode steps replayed as CUDA graphs (`policy.graphs`);
- trainer: gradient checkpointing (activations of one layer at a time, recomputed in backward) and
  the lm_head only on the loss tokens (`ModelHost.loss_tokens_only`).

    host = make_host("qwen3-vl-8b-shape", LoraSettings(32, 64), dtype=torch.bfloat16,
                     device="cuda", hash_weights=False)
    configure_gpu(host, kv_rows=64, kv_tokens=2048)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuSettings:
    """Speed settings of a GPU host (each can be switched off to measure what it brings)."""

    gqa_decode: bool = True  # one-token steps read each KV head once
    cuda_graphs: bool = True  # pooled KV + graph-replayed decode steps (eager static steps if off)
    kv_rows: int = 64  # rows the KV pool is sized for (P x G of a rollout)
    kv_tokens: int = 2048  # tokens per row the KV pool is sized for (grown if exceeded)
    bucket: int = 256  # decode attention window granularity (one graph per bucket)
    gradient_checkpointing: bool = True  # recompute each layer's activations in backward
    loss_tokens_only: bool = True  # lm_head only where the loss weight is non-zero


def configure_gpu(host: Any, settings: GpuSettings = GpuSettings()) -> Any:
    """Apply `settings` to `host` (a session.inprocess.ModelHost); returns the StaticDecode or
    None. Call it before the first rollout."""
    from workbench.policy.attention import use_gqa_decode_attention
    from workbench.policy.graphs import GraphEngine, make_static_decode

    model = host.lm.model
    if settings.gqa_decode:
        use_gqa_decode_attention(model)
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    host.loss_tokens_only = settings.loss_tokens_only
    static = make_static_decode(model, settings.kv_rows, settings.kv_tokens, settings.bucket,
                                use_graphs=settings.cuda_graphs and model.device.type == "cuda")
    host.engine = GraphEngine(host.lm, static)
    return static


@dataclass(frozen=True)
class SpeedSettings:
    """What a run's config switches on (its keys in brackets); see `apply_speed`."""

    gradient_checkpointing: bool = False  # trainer.gradient_checkpointing
    loss_tokens_only: bool = False  # trainer.loss_tokens_only
    cuda_graphs: bool = False  # generator.cuda_graphs, on a CUDA device with our sampler
    kv_rows: int = 64  # rows of a rollout (P x G): the KV pool's size


def apply_speed(host: Any, speed: SpeedSettings, trainer: bool = True,
                sampler: bool = True) -> None:
    """The trainer switches and/or the sampler's CUDA-graph decode on a host: both in-process,
    one side in a Ray trainer worker or sampler engine (no KV pool where nothing samples)."""
    model = host.lm.model
    if sampler and speed.cuda_graphs and model.device.type == "cuda":
        configure_gpu(host, GpuSettings(kv_rows=speed.kv_rows, gradient_checkpointing=False,
                                        loss_tokens_only=host.loss_tokens_only))
    if trainer:
        host.loss_tokens_only = speed.loss_tokens_only
        if speed.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
