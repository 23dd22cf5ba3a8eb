"""What a session is opened with: one frozen record for every backend.

    spec = SessionSpec(model="tiny-sft", lora=LoraSettings(rank=8), workdir="runs/x")
    session = open_session(spec)                      # workbench.opener: in-process or Ray

`workbench.opener.session_spec(config, run_dir)` builds it from a `RunConfig`; train, SFT, eval,
replay, the notebooks and the Ray actors all open their sessions from it, so none of them can
drop a setting the others honour (dtype, device, engine, speed, cluster).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench.model.lora import LoraSettings
from workbench.policy.engine import EngineSettings


@dataclass(frozen=True)
class SpeedSettings:
    """The fast paths a host is built with (all off by default: the CPU path). Each can be
    switched off alone to measure what it brings (benchmarks/gpu.py).

    Sampler side (a CUDA device with the transformers engine): `cuda_graphs` puts the decode on a
    KV pool sized for the rollout and replays each step as a CUDA graph (`policy.graphs`), with
    grouped-query decode attention, through a merged, fused copy of the text weights
    (`policy.fused`), optionally torch.compile'd. Trainer side: gradient checkpointing, the
    lm_head only on loss tokens, LoRA in bf16 under autocast, compiled decoder layers."""

    cuda_graphs: bool = False  # generator.cuda_graphs (CUDA + transformers engine only)
    gqa_decode: bool = True  # with cuda_graphs: one-token steps read each KV head once
    kv_rows: int = 64  # rows the KV pool is sized for (P x G of a rollout)
    kv_tokens: int = 2048  # tokens per row the KV pool is sized for (grown if exceeded)
    bucket: int = 256  # decode attention window granularity (one graph per bucket)
    fused_decode: bool = True  # generator.fused_decode (with cuda_graphs)
    compile_decode: bool = False  # generator.compile_decode (with fused_decode)
    gradient_checkpointing: bool = False  # trainer.gradient_checkpointing
    selective_checkpointing: bool = False  # trainer.selective_checkpointing
    compile_layers: bool = False  # trainer.compile_layers
    loss_tokens_only: bool = False  # trainer.loss_tokens_only
    share_prefix: bool = False  # trainer.share_prefix
    lora_autocast: bool = False  # trainer.lora_autocast


@dataclass(frozen=True)
class ClusterSpec:
    """Where the session runs: in this process (address "") or on Ray actors."""

    address: str = ""  # "" | local | auto | ray://host:10001 (cluster.address)
    num_cpus: int = 0  # CPUs a local Ray instance may use (0 = all)
    num_gpus: int = 0  # GPUs a local Ray instance may use (0 = Ray detects them)
    dashboard: bool = False  # Ray's dashboard with a local instance
    temp_dir: str = ""  # temp/log folder of a local Ray instance
    num_workers: int = 1  # data-parallel trainer actors
    num_engines: int = 1  # sampler actors (0: a trainer-only session, e.g. SFT)
    colocate_all: bool = True  # trainer i and engine i share placement bundle i
    strategy: str = "ddp"  # ddp | fsdp
    cpus_per_actor: float = 0.5  # CPU share reserved for each actor
    threads_per_actor: int = 0  # torch threads in each actor (0 = Ray's default)

    @property
    def on_ray(self) -> bool:
        return bool(self.address)


@dataclass(frozen=True)
class SessionSpec:
    """Model, LoRA, folder, dtype, device, sampler engine, fast paths and backend of a session."""

    model: str = "tiny"  # "tiny", "tiny-sft", a checkpoint folder or a hub id
    lora: LoraSettings | None = field(default_factory=LoraSettings)  # None: full fine-tuning
    workdir: str = "runs/session"  # states/, exports/ and engine adapters go here
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda
    engine: EngineSettings = field(default_factory=EngineSettings)
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype {self.dtype!r} is not a torch dtype "
                             "(float32 | bfloat16 | float16)")
        return dtype
