"""A model host and the functions over it: the whole behaviour of a session.

    host = make_host(SessionSpec(model="tiny", lora=LoraSettings(rank=8)))
    out = forward(host, datums, "ppo", LossConfig(), backward=True)
    optim_step(host, AdamParams(learning_rate=3e-4))
    version = save_version(host)                      # a sampler weights version
    play(host, states_P, version, loop, task, n, params, seed)

The clients (`session.clients`) send these functions to a host through the session's executor:
the in-process `Session` runs them on its threads, the Ray trainer workers and sampler engines
inside their actors (`workbench.cluster.workers`). A host holds the policy, its optimiser, the
sampler engine and the sampler weight versions; the trainer's own weights are parked aside
(`ModelHost.parked`) while a sampler version is loaded.

The episode loop is not the host's: `play` runs a loop handed in by the caller (`rl.rollout`'s
`play_episodes`, over any environment that follows `envs.protocol`) beside the sampler.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from workbench.engines import make_engine
from workbench.model import LoadedModel, LoraSettings, add_lora, load_model, weights_hash
from workbench.model.lora import adapted_layers, lora_in_model_dtype
from workbench.model.vision import batch_vision_attention, linear_patch_embed
from workbench.policy import ChatFormat, SamplingParams, Stream, chat_format
from workbench.policy.engine import Engine, EngineSettings
from workbench.policy.forward import token_logprobs, upload
from workbench.sampler.graphs import graph_metrics
from workbench.session.losses import (
    LOSSES,
    REDUCTIONS,
    LossConfig,
    metric_tensors,
    read_metrics,
    truncated_is,
)
from workbench.session.spec import SessionSpec, SpeedSettings
from workbench.session.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepOutput,
    SampleResponse,
    empty_output,
)

KEEP_VERSIONS = 4  # sampler weight snapshots kept besides the newest


@dataclass
class ModelHost:
    """Everything a session's worker owns: policy, optimiser, sampler weight versions."""

    lm: LoadedModel  # lm.model is the peft-wrapped policy (or the bare model: full fine-tuning)
    fmt: ChatFormat
    lora: LoraSettings | None  # None = full fine-tuning (every parameter trains)
    base_hash: str  # sha256 of the base weights (adapters refuse other bases)
    workdir: Path
    optimizer: torch.optim.Optimizer
    engine: Engine  # draws samples (engine.name); follows the sampler versions below
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    fp8_base: bool = False  # the update runs the frozen base in FP8 (speed.fp8_base, session.fp8)
    opt_steps: int = 0
    weights_id: int = 0  # bumps whenever the trainable weights change
    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    parked: dict[str, torch.Tensor] | None = None  # the trainer's weights while a version is in
    loaded_version: int | None = None  # which snapshot is in the model (None = trainer's)
    # sums the gradients over data-parallel replicas before they are used (a Ray trainer worker
    # of several sets it: cluster.parallel.all_reduce_grads); None: this host is the only one
    sum_grads: Callable[[list[torch.nn.Parameter]], None] | None = None
    # the policy's modules and its adapted layers, listed once (make_host): each update call
    # switches train mode and peft's input cast over them instead of walking the module tree
    # (3,367 modules at the 8B shape) while the GPU waits
    modules: tuple[torch.nn.Module, ...] = ()
    adapted: tuple[torch.nn.Module, ...] = ()
    # several LoRA adapters over this one base (`session.tenants`): the one in the model, and
    # the others parked with their gradients and optimiser moments ("" is the spec's own)
    tenant: str = ""
    tenants: dict[str, Any] = field(default_factory=dict)

    @property
    def pad_id(self) -> int:
        return self.lm.processor.tokenizer.pad_token_id

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.lm.model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------- building a host

def make_host(spec: SessionSpec, trainer: bool = True, sampler: bool = True,
              weights: bool = True) -> ModelHost:
    """Load the base, hash it (trainer hosts: adapters and states refuse other bases), wrap it in
    LoRA (spec.lora None: train all weights), make the optimiser and the sampler engine, and
    switch on the spec's fast paths for the sides this host plays (a Ray trainer worker: trainer
    only; a sampler engine: sampler only; in-process: both). weights=False (a vLLM sampler whose
    versions its colocated trainer sends, `cluster.workers`): the model's structure only, on the
    meta device; vLLM holds the one copy of the weights in this process."""
    if not weights and (trainer or spec.engine.name != "vllm"):
        raise ValueError("only a vLLM sampler host can be built without the model's weights")
    lm = load_model(spec.model, dtype=spec.torch_dtype, device=spec.device if weights else "meta")
    base_hash = weights_hash(lm.model) if trainer else ""
    if spec.lora is not None:
        lm.model = add_lora(lm.model, spec.lora).eval()
    params = [p for p in lm.model.parameters() if p.requires_grad]
    adapters = Path(spec.workdir) / "sampler_adapters" / str(os.getpid())  # one per process
    # A trainer-only host (a Ray trainer worker) samples nothing: the plain engine, which holds
    # no memory, not a second vLLM beside the engine actor's (it cost a trainer its GPU share)
    engine = spec.engine if sampler else EngineSettings("transformers")
    if weights:
        batch_vision_attention(lm.model)  # one attention call a vision layer (model/vision.py)
        linear_patch_embed(lm.model)  # the patch convolution as one matrix product
    host = ModelHost(
        lm=lm, fmt=chat_format(lm.processor), lora=spec.lora, base_hash=base_hash,
        # fused: one kernel over all parameters, 14x faster than the per-tensor loop on 2 cores
        workdir=Path(spec.workdir), optimizer=torch.optim.AdamW(params, lr=1e-4, fused=True),
        engine=make_engine(engine, lm, spec.lora.rank if spec.lora else None, adapters),
        speed=spec.speed,
    )
    if trainer:
        _trainer_fast_paths(host, spec.speed)
    host.modules, host.adapted = tuple(lm.model.modules()), adapted_layers(lm.model)
    return host


def _trainer_fast_paths(host: ModelHost, speed: SpeedSettings) -> None:
    from workbench.session.gpu import compile_for_training, set_checkpointing

    if speed.gradient_checkpointing:
        set_checkpointing(host.lm.model, True, speed.selective_checkpointing)
    if speed.fp8_base:  # before compile_layers: the compiled layers trace the FP8 forward
        from workbench.deps import warn_fallback
        from workbench.session.fp8 import fp8_unsupported, use_fp8_base

        if reason := fp8_unsupported(host.lm.model):
            warn_fallback("speed.fp8_base", reason)
        else:
            use_fp8_base(host.lm.model)
            host.fp8_base = True
    if speed.compile_layers:
        compile_for_training(host.lm.model)


def speed_metrics(host: ModelHost) -> dict[str, float]:
    """`speed/*`: 1.0 for each fast path this host runs, 0.0 for one that fell back (its
    warning said why); nothing for paths that were never asked for. The sampler's and the
    trainer's (a Ray engine or trainer worker plays one side: `sampler_metrics`,
    `trainer_metrics`), and `memory/gpu_peak_gb`."""
    return sampler_metrics(host) | trainer_metrics(host)


def sampler_metrics(host: ModelHost) -> dict[str, float]:
    """The sampler's side of `speed_metrics`: vLLM's prefix cache (`vllm/*`), CUDA graphs and
    the compiled decode, and this process's `memory_metrics`."""
    cache = getattr(host.engine, "cache_metrics", None)  # the vLLM engine's prefix cache
    out: dict[str, float] = (cache() if cache else {}) | memory_metrics(host)
    static = getattr(host.engine, "static", None)  # our engine over CUDA graphs
    return out if static is None else out | graph_metrics(static)


def trainer_metrics(host: ModelHost) -> dict[str, float]:
    """The trainer's side of `speed_metrics`: FP8 in the frozen base, cuDNN's attention, and
    this process's `memory_metrics`."""
    out = memory_metrics(host)
    if host.speed.fp8_base:
        out["speed/fp8_base"] = float(host.fp8_base)
    if uses_cudnn_attention(host):
        out["speed/cudnn_attention"] = 1.0
    return out


def memory_metrics(host: ModelHost) -> dict[str, float]:
    """`memory/gpu_peak_gb`: the peak of torch's GPU allocations in this process so far, plus a
    vLLM engine's whole budget (engine.gpu_memory_utilization of the GPU) when its engine core
    runs in a process of its own (vLLM's default; in a Ray engine actor it runs in the actor and
    torch counts its allocations); {} without CUDA."""
    if not torch.cuda.is_available():
        return {}
    peak = torch.cuda.max_memory_allocated()
    if getattr(host.engine, "name", "") == "vllm":
        from workbench.vllm.merged import engine_in_process

        if not engine_in_process():
            share: float = host.engine.gpu_share  # type: ignore[attr-defined]
            peak += int(share * torch.cuda.mem_get_info()[1])
    return {"memory/gpu_peak_gb": peak / 1e9}


def describe_host(host: ModelHost) -> dict[str, Any]:
    """Model source, base hash, LoRA settings, fast paths (for manifests)."""
    lora = asdict(host.lora) if host.lora else None
    return {"model": host.lm.source, "model_path": host.lm.path,
            "base_weights_sha256": host.base_hash, "lora": lora, "speed": asdict(host.speed)}


def trainable_bytes(host: ModelHost) -> int:
    """Bytes of the trainable tensors (what a weight sync sends)."""
    return sum(p.numel() * p.element_size() for p in host.trainable().values())


def close(host: ModelHost) -> None:
    """Free what the host holds on its device: the sampler engine (vLLM's engine core), then the
    policy's weights, gradients and optimiser state (the model goes to the meta device), so a
    notebook that closes a session and opens another gets the memory back while its variables
    still name the first. The host serves no call after this."""
    host.engine.close()
    host.optimizer.state.clear()
    host.versions.clear()
    host.parked = None
    if host.fp8_base:
        from workbench.session.fp8 import drop_fp8_base

        drop_fp8_base(host.lm.model)
    host.lm.model.to("meta")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------- sampler weight versions

def trainer_weights(host: ModelHost) -> None:
    """Put the trainer's own weights back into the model (after a sampler version was in)."""
    if host.loaded_version is not None:
        if host.parked is not None:
            _copy_in(host, host.parked)
        host.parked, host.loaded_version = None, None


def _copy_in(host: ModelHost, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in host.trainable().items():
            p.copy_(tensors[name])


def snapshot(host: ModelHost) -> dict[str, torch.Tensor]:
    """A copy of the trainable tensors as they are in the model now."""
    return {n: p.detach().clone() for n, p in host.trainable().items()}


def use_version(host: ModelHost, version: int) -> None:
    """Sample from version `version`. An engine with weights of its own (vLLM) takes the
    version's snapshot and the model is left to the trainer; otherwise the version's weights go
    into the model (the trainer's are parked)."""
    if host.engine.samples_own_weights:
        host.engine.use_version(version, version_tensors(host, version))
        return
    load_version(host, version)
    host.engine.use_version(version, None)


def version_tensors(host: ModelHost, version: int) -> dict[str, torch.Tensor]:
    """Version `version`'s snapshot of the trainable weights, or KeyError once it was pruned."""
    if version not in host.versions:
        raise KeyError(f"sampler version {version} was dropped (only the last "
                       f"{KEEP_VERSIONS + 1} are kept); get a new sampling client")
    return host.versions[version]


def load_version(host: ModelHost, version: int) -> None:
    """Put version `version`'s weights into the model (the trainer's are parked)."""
    trainer_current = host.loaded_version is None and version == host.weights_id
    if host.loaded_version == version or trainer_current:
        return
    tensors = version_tensors(host, version)
    if host.loaded_version is None:  # the trainer's weights are in the model: park them
        host.parked = snapshot(host)
    _copy_in(host, tensors)
    host.loaded_version = version


def save_version(host: ModelHost) -> int:
    """Snapshot the trainer's weights as sampler version `host.weights_id`; returns it."""
    trainer_weights(host)
    host.versions[host.weights_id] = snapshot(host)
    host.engine.add_version(host.weights_id, host.lm.model)
    _prune_versions(host, host.weights_id)
    return host.weights_id


def _prune_versions(host: ModelHost, newest: int) -> None:
    for old in [v for v in host.versions if v < newest - KEEP_VERSIONS]:
        del host.versions[old]  # bounded memory: recent sampler versions only
        host.engine.drop_version(old)


def install_version(host: ModelHost, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """A sampler-only host receives version `version` from the trainer and loads it (the
    tensors kept on the model's device: an engine that merges them reads them there)."""
    device = next(iter(host.trainable().values())).device
    tensors = {name: t.to(device) for name, t in tensors.items()}
    host.versions[version] = tensors
    _copy_in(host, tensors)
    host.loaded_version = version
    host.engine.add_version(version, host.lm.model)
    _prune_versions(host, max(host.versions))


def hold_version(host: ModelHost, version: int) -> None:
    """A sampler-only host's engine was handed version `version` whole by its colocated
    trainer (`cluster.workers.TrainerWorker.hand_version`): the host keeps no tensors of it."""
    host.versions[version] = {}
    host.loaded_version = version
    _prune_versions(host, max(host.versions))


# ------------------------------------------------------------------------------- the sampler

def sample(host: ModelHost, version: int, prompt: Stream, num_samples: int,
           params: SamplingParams, seed: int) -> SampleResponse:
    """num_samples replies to one prompt from version `version`."""
    use_version(host, version)
    gen = torch.Generator().manual_seed(seed)
    done = host.engine.open([prompt], num_samples).decode(params, gen)
    return SampleResponse(sequences=done)


def compute_logprobs(host: ModelHost, version: int, prompt: Stream, temperature: float
                     ) -> list[float]:
    """Per-token log-probs of the prompt's own tokens under version `version` (the model's
    forward, whatever the engine)."""
    load_version(host, version)
    with torch.no_grad():
        logp, _ = token_logprobs(host.lm.model, [prompt], temperature, host.fmt.banned,
                                 host.pad_id)
    return logp[0].tolist()


class EpisodeLoop(Protocol):
    """Plays n episodes from each initial state of a task with an engine: episodes_P_G. The
    session runs it beside the sampler without knowing the task (`rl.rollout.play_episodes`)."""

    def __call__(self, lm: LoadedModel, engine: Engine, task: Any, init_states_P: list[Any],
                 n: int, params: SamplingParams, seed: int) -> list[list[Any]]: ...


def play(host: ModelHost, init_states_P: list[Any], version: int, loop: EpisodeLoop, task: Any,
         n: int, params: SamplingParams, seed: int) -> list[list[Any]]:
    """Run the episode loop over version `version`: n episodes from each initial state,
    episodes_P_G (the states lead: a Ray session splits them over its engines)."""
    use_version(host, version)
    return loop(host.lm, host.engine, task, init_states_P, n, params, seed)


# ------------------------------------------------------------------------------- the trainer

def warn_if_empty(call: str, datums: list[Datum]) -> None:
    """A client's RuntimeWarning for a call without datums (Python shows it once per calling
    line): the output is marked empty, and its loss 0.0 is not a loss."""
    if not datums:
        warnings.warn(f"{call} got 0 datums: nothing computed, no gradient; its output is "
                      "marked empty (out.empty), its loss 0.0 is no loss", RuntimeWarning,
                      stacklevel=3)


@dataclass
class LaunchedForward:
    """A forward(_backward) call whose work is queued on the device and whose results are not
    read back yet (`read_back`): loss, metrics (`losses.metric_tensors`) and the trainer's
    log-probs of each datum, as tensors."""

    loss: torch.Tensor
    metrics: dict[str, Any]
    logprobs_B_T: list[torch.Tensor]


def forward(host: ModelHost, datums: list[Datum], loss_fn: str, cfg: LossConfig,
            backward: bool) -> ForwardBackwardOutput:
    """Loss, metrics and trainer log-probs of the datums; with backward, gradients accumulate.
    No datums: an output marked empty (nothing computed; the client warns)."""
    return read_back(launch_forward(host, datums, loss_fn, cfg, backward))


def launch_forward(host: ModelHost, datums: list[Datum], loss_fn: str, cfg: LossConfig,
                   backward: bool) -> LaunchedForward | ForwardBackwardOutput:
    """`forward` up to its results: the forward (and backward) queued on the device without the
    host waiting for it, so the next call's host work can run while the GPU computes this one.
    No datums: the empty output itself."""
    if loss_fn not in LOSSES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; choose one of {sorted(LOSSES)}")
    if not datums:
        return empty_output()
    trainer_weights(host)
    model = host.lm.model
    set_training(host.modules, backward)
    with torch.set_grad_enabled(backward), sdpa_order(host), \
            lora_in_model_dtype(model, host.speed.lora_autocast, host.adapted):
        streams = [d.stream for d in datums]
        weighted_B_T = [[w != 0 for w in d.weights_T] for d in datums]  # the loss's tokens
        keep = weighted_B_T if host.speed.loss_tokens_only else None
        logp_B_T, ent_B_T = token_logprobs(model, streams, cfg.temperature, host.fmt.banned,
                                           host.pad_id, keep, host.speed.share_prefix)
        device = logp_B_T[0].device  # the side tables go where the model is (cuda on GPU)
        sampler_B_T = side_table([s.logprobs_T for s in streams], device)
        adv_B_T = side_table([d.advantages_T for d in datums], device)
        w_B_T = side_table([d.weights_T for d in datums], device)
        # Observation tokens (weight 0) may be banned for sampling (-inf): keep them out of
        # the arithmetic, since 0 * -inf is nan.
        logp_B_T = [torch.where(w != 0, lp, torch.zeros_like(lp)) for lp, w in zip(logp_B_T, w_B_T)]
        base_B_T, weight_B_T = truncated_is(logp_B_T, sampler_B_T, w_B_T, cfg.tis_cap) \
            if cfg.tis_cap else (sampler_B_T, w_B_T)  # the ratio's base, the tokens' weights
        loss_B_T = [LOSSES[loss_fn](lp, base, a, w, cfg)
                    for lp, base, a, w in zip(logp_B_T, base_B_T, adv_B_T, weight_B_T)]
        loss = REDUCTIONS[cfg.reduction](loss_B_T, w_B_T)
        if backward:
            loss.backward()
    set_training(host.modules, False)
    detached = [lp.detach() for lp in logp_B_T]
    tokens = sum(map(sum, weighted_B_T))
    return LaunchedForward(loss.detach(), metric_tensors(
        detached, sampler_B_T, w_B_T, [e.detach() for e in ent_B_T], cfg, tokens), detached)


def sdpa_order(host: ModelHost) -> contextlib.AbstractContextManager:
    """The update's SDPA backends in order: cuDNN's first with `speed.cudnn_attention` on a CUDA
    device, else PyTorch's own order. Compiled layers take the order they were compiled under:
    every update call runs under the same one."""
    if not uses_cudnn_attention(host):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)


def uses_cudnn_attention(host: ModelHost) -> bool:
    """Whether the update puts cuDNN's attention first (`speed.cudnn_attention` on CUDA)."""
    return host.speed.cudnn_attention and host.lm.model.device.type == "cuda"


def read_back(launched: LaunchedForward | ForwardBackwardOutput) -> ForwardBackwardOutput:
    """A launched call's results as Python numbers: the host waits here for its device work."""
    if isinstance(launched, ForwardBackwardOutput):
        return launched
    loss = float(launched.loss)
    flat = torch.cat(launched.logprobs_B_T).tolist()
    bounds = np.cumsum([0] + [len(lp) for lp in launched.logprobs_B_T])
    return ForwardBackwardOutput(loss, {"loss": loss} | read_metrics(launched.metrics),
                                 [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])])


def side_table(values_B_T: list[Any], device: torch.device) -> list[torch.Tensor]:
    """Per-datum float lists as tensors on `device`, sent in one upload (`forward.upload`)."""
    flat = upload(torch.tensor([x for values in values_B_T for x in values],
                               dtype=torch.get_default_dtype()), device)
    return list(flat.split([len(values) for values in values_B_T]))


def set_training(modules: tuple[torch.nn.Module, ...], on: bool) -> None:
    """`model.train(on)` over a model's modules listed once: each module's `training` flag
    written straight into its __dict__ (where nn.Module keeps it), no tree walk and no
    __setattr__ checks."""
    for module in modules:
        module.__dict__["training"] = on


def _summed_grads(host: ModelHost) -> list[torch.nn.Parameter]:
    """The trainable parameters, their gradients summed over the replicas (`sum_grads`)."""
    trainer_weights(host)
    params = list(host.trainable().values())
    if host.sum_grads is not None:
        host.sum_grads(params)
    return params


def optim_step(host: ModelHost, adam: AdamParams) -> OptimStepOutput:
    """Sum the gradients over the replicas, clip the global grad norm, step AdamW with `adam`,
    zero the gradients."""
    params = _summed_grads(host)
    max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    for group in host.optimizer.param_groups:
        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                     weight_decay=adam.weight_decay)
    host.optimizer.step()
    host.optimizer.zero_grad(set_to_none=True)
    host.opt_steps += 1
    host.weights_id += 1
    return OptimStepOutput(step=host.opt_steps, grad_norm=grad_norm,
                           learning_rate=adam.learning_rate)


def grad_squares(host: ModelHost, datums: list[Datum], loss_fn: str, cfg: LossConfig
                 ) -> dict[str, float]:
    """Squared gradient norm of each trainable parameter (those with a gradient) for these
    datums, summed over the replicas, without stepping: the gradients, and any accumulated
    before, are dropped afterwards."""
    forward(host, datums, loss_fn, cfg, backward=True)
    _summed_grads(host)
    squares = {name: float(p.grad.detach().double().pow(2).sum())
               for name, p in host.trainable().items() if p.grad is not None}
    host.optimizer.zero_grad(set_to_none=True)
    return squares

