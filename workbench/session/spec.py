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
    """The trainer's fast paths (the `speed.*` keys of a run; the sampler's are the engine's,
    `EngineSettings`). Each can be switched off alone to measure what it brings
    (benchmarks/gpu.py)."""

    gradient_checkpointing: bool = False
    """Recompute each layer's activations in backward instead of keeping them (the 8B shape
    needs it on one GPU; SkyRL: trainer.gradient_checkpointing). Same gradients, more time."""
    selective_checkpointing: bool = False
    """With gradient_checkpointing: keep each layer's matmul and attention outputs and recompute
    only the elementwise ops (norms, rotary, SiLU, casts) in backward."""
    compile_layers: bool = False
    """torch.compile each text decoder layer for the update; the first update pays the
    compilation (about a minute), calls without grad (the sampler's prefill) stay eager."""
    loss_tokens_only: bool = False
    """Run the lm_head only on tokens that carry loss weight (the replies): at Qwen's 151,936
    vocabulary this saves most of the output layer's time and memory. Same loss and gradients."""
    share_prefix: bool = False
    """Run the prompt the G episodes of a maze share (system prompt and first observation) once
    per group in the update and continue each episode from its KV cache (the same log-probs and
    gradients; `policy.forward.token_logprobs`). Ignored with compile_layers."""
    lora_autocast: bool = False
    """On a bf16 base: compute the LoRA adapters in bf16 under autocast instead of peft's float32
    path; adapter weights, gradients and Adam stay float32. Ignored on float32 models."""
    cudnn_attention: bool = False
    """On a CUDA device: the update's attention (SDPA: the text layers' causal attention, the
    vision tower's) tries cuDNN's fused kernel first, then flash, memory-efficient and math
    (PyTorch's backend priority, `session.host.sdpa_order`); a shape cuDNN refuses takes the
    next. The same attention to bf16 rounding, about twice flash's speed forward and backward at
    the 8B shape's update (benchmarks/RESULTS.md, "The update"). Ignored on CPU."""
    fp8_base: bool = False
    """With a LoRA adapter on a bf16 model and an FP8 GPU (compute capability 8.9+): the update
    runs the frozen base's text linear layers in FP8 (e4m3, row-wise scales, quantisation
    compiled into one kernel), forward and the activation gradient; the adapter, its gradients
    and Adam are unchanged, calls without grad stay bf16 (`session.fp8`). Costs an FP8 copy of
    the text matrices (half their bf16 size). Elsewhere it falls back, saying why."""


@dataclass(frozen=True)
class ClusterSpec:
    """Where the session runs: in this process (address "") or on Ray actors (README, "Ray")."""

    address: str = ""
    """"" = in-process (no Ray); "local" = start Ray here; "auto" = the running cluster (or
    RAY_ADDRESS); "ray://host:10001" = a remote cluster through Ray Client."""
    num_cpus: int = 0
    """CPUs a local Ray instance may use (0 = all of this machine's)."""
    num_gpus: int = 0
    """GPUs a local Ray instance may use (0 = Ray detects them)."""
    dashboard: bool = False
    """Start Ray's dashboard with a local instance (bound to 127.0.0.1)."""
    temp_dir: str = ""
    """Temp/log folder of a local Ray instance ("" = Ray's default, /tmp/ray)."""
    num_workers: int = 1
    """N: data-parallel trainer actors; each takes a slice of the datums and gradients are
    all-reduced (SkyRL: trainer.placement.policy_num_gpus_per_node). Ignored in-process."""
    num_engines: int = 1
    """M: sampler actors; a rollout's mazes are spread over them (SkyRL:
    generator.num_inference_engines; 0: a trainer-only session, e.g. SFT). Ignored in-process."""
    colocate_all: bool = True
    """Trainer worker i and sampler engine i share placement-group bundle i (fractional GPU);
    false gives them separate bundles (SkyRL: trainer.placement.colocate_all)."""
    strategy: str = "ddp"
    """Data-parallel strategy of the trainer actors: ddp (replicas, gradients all-reduced) |
    fsdp (GPU only: the frozen base is sharded over the workers, LoRA weights all-reduced)."""
    cpus_per_actor: float = 0.5
    """CPU share reserved for each trainer worker and each sampler engine."""
    threads_per_actor: int = 0
    """torch CPU threads in each actor (0 = Ray's default: its CPU share, at least 1). Trainer
    and engines of a synchronous loop take turns, so colocated actors may each use the whole
    bundle's cores."""
    max_restarts: int = 3
    """Times a run reopens its session from the last checkpoint after a Ray actor died."""

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
