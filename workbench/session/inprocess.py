"""The training-session primitives (seed 003 / Tinker's shape), in-process backend.

    session = create_session(model="tiny", lora=LoraSettings(rank=8), workdir="runs/x")
    tc = session.training_client
    fb = tc.forward_backward(datums, "ppo")          # returns a future at once
    opt = tc.optim_step(AdamParams(learning_rate=3e-4))  # queued behind forward_backward
    fb.result(), opt.result()
    sampler = tc.save_weights_and_get_sampling_client()
    sampler.sample(prompt_stream, 4, SamplingParams()).result()

Every call returns a `concurrent.futures.Future`. All calls that touch the model run on one
worker thread in submission order, so a forward_backward and an optim_step may both be submitted
before either is awaited. A SamplingClient is bound to the weights version it was created with:
it swaps that LoRA snapshot in for its calls and the trainer's weights back afterwards.

The module functions over a `ModelHost` (`_forward`, `_optim_step`, `_sample`, `_rollout`, ...)
are the whole behaviour; the Ray backend (`workbench.cluster`) runs the same functions inside its
trainer and sampler actors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from workbench.envs import InitState, MazeConfig
from workbench.model import LoadedModel, LoraSettings, add_lora, load_model, weights_hash
from workbench.model.lora import lora_in_model_dtype
from workbench.policy import ChatFormat, SamplingParams, Stream, chat_format
from workbench.policy.engine import Engine, EngineSettings, make_engine
from workbench.policy.forward import token_logprobs
from workbench.session import checkpoint
from workbench.session.losses import LOSSES, REDUCTIONS, LossConfig, loss_metrics
from workbench.session.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepOutput,
    SampleResponse,
)

KEEP_VERSIONS = 4  # sampler weight snapshots kept besides the newest


@dataclass
class ModelHost:
    """Everything the worker thread owns: policy, optimiser, sampler weight versions."""

    lm: LoadedModel  # lm.model is the peft-wrapped policy (or the bare model: full fine-tuning)
    fmt: ChatFormat
    lora: LoraSettings | None  # None = full fine-tuning (every parameter trains)
    base_hash: str  # sha256 of the base weights (adapters refuse other bases)
    workdir: Path
    optimizer: torch.optim.Optimizer
    engine: Engine  # draws samples (generator.engine); follows the sampler versions below
    opt_steps: int = 0
    weights_id: int = 0  # bumps whenever the trainable weights change
    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    loaded_version: int | None = None  # which snapshot is in the model (None = trainer's)
    loss_tokens_only: bool = False  # lm_head only on weighted tokens in forward(_backward)
    lora_autocast: bool = False  # adapters in the base dtype in forward(_backward) (bf16 bases)

    @property
    def pad_id(self) -> int:
        return self.lm.processor.tokenizer.pad_token_id

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.lm.model.named_parameters() if p.requires_grad}


def _with_trainer_weights(host: ModelHost) -> None:
    if host.loaded_version is not None:
        _copy_in(host, host.versions[-1])
        host.loaded_version = None


def _copy_in(host: ModelHost, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in host.trainable().items():
            p.copy_(tensors[name])


def _snapshot(host: ModelHost) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in host.trainable().items()}


def _use_version(host: ModelHost, version: int) -> None:
    """Sample from version `version`: its weights go into the model (the trainer's are kept
    aside) and the engine is told."""
    _load_version(host, version)
    host.engine.use_version(version)


def _load_version(host: ModelHost, version: int) -> None:
    trainer_current = host.loaded_version is None and version == host.weights_id
    if host.loaded_version == version or trainer_current:
        return
    if version not in host.versions:
        raise KeyError(f"sampler version {version} was dropped (only the last "
                       f"{KEEP_VERSIONS + 1} are kept); get a new sampling client")
    if host.loaded_version is None:
        host.versions[-1] = _snapshot(host)  # the trainer's live weights
    _copy_in(host, host.versions[version])
    host.loaded_version = version


def _save_version(host: ModelHost) -> int:
    """Snapshot the trainer's weights as sampler version `host.weights_id`; returns it."""
    _with_trainer_weights(host)
    host.versions[host.weights_id] = _snapshot(host)
    host.engine.add_version(host.weights_id, host.lm.model)
    _prune_versions(host, host.weights_id)
    return host.weights_id


def _prune_versions(host: ModelHost, newest: int) -> None:
    for old in [v for v in host.versions if 0 <= v < newest - KEEP_VERSIONS]:
        del host.versions[old]  # bounded memory: recent sampler versions only
        host.engine.drop_version(old)


def _install_version(host: ModelHost, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """A sampler-only host receives version `version` from the trainer and loads it."""
    host.versions[version] = tensors
    _copy_in(host, tensors)
    host.loaded_version = version
    host.engine.add_version(version, host.lm.model)
    _prune_versions(host, max(host.versions))


def _sample(host: ModelHost, prompt: Stream, num_samples: int, params: SamplingParams,
            seed: int) -> SampleResponse:
    gen = torch.Generator().manual_seed(seed)
    done = host.engine.open([prompt], num_samples).decode(params, gen)
    return SampleResponse(sequences=done)


def _compute_logprobs(host: ModelHost, prompt: Stream, temperature: float) -> list[float]:
    with torch.no_grad():
        logp, _ = token_logprobs(host.lm.model, [prompt], temperature, host.fmt.banned,
                                 host.pad_id)
    return logp[0].tolist()


def _rollout(host: ModelHost, config: MazeConfig, init_states_P: list[InitState], n: int,
             params: SamplingParams, seed: int) -> list:
    from workbench.rl.rollout import play_model

    gen = torch.Generator().manual_seed(seed)
    return play_model(host.lm, config, init_states_P, n, params, gen, host.engine)


def _forward(host: ModelHost, datums: list[Datum], loss_fn: str, cfg: LossConfig,
             backward: bool) -> ForwardBackwardOutput:
    if loss_fn not in LOSSES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; choose one of {sorted(LOSSES)}")
    _with_trainer_weights(host)
    model = host.lm.model
    model.train(backward)
    with torch.set_grad_enabled(backward), lora_in_model_dtype(model, host.lora_autocast):
        streams = [d.stream for d in datums]
        keep = [[w != 0 for w in d.weights_T] for d in datums] if host.loss_tokens_only else None
        logp_B_T, ent_B_T = token_logprobs(model, streams, cfg.temperature, host.fmt.banned,
                                           host.pad_id, keep)
        device = logp_B_T[0].device  # the side tables go where the model is (cuda on GPU)
        sampler_B_T = [torch.tensor(s.logprobs_T, device=device) for s in streams]
        adv_B_T = [torch.tensor(d.advantages_T, device=device) for d in datums]
        w_B_T = [torch.tensor(d.weights_T, device=device) for d in datums]
        # Observation tokens (weight 0) may be banned for sampling (-inf): keep them out of
        # the arithmetic, since 0 * -inf is nan.
        logp_B_T = [torch.where(w != 0, lp, torch.zeros_like(lp)) for lp, w in zip(logp_B_T, w_B_T)]
        loss_B_T = [LOSSES[loss_fn](lp, sp, a, w, cfg)
                    for lp, sp, a, w in zip(logp_B_T, sampler_B_T, adv_B_T, w_B_T)]
        loss = REDUCTIONS[cfg.reduction](loss_B_T, w_B_T)
        if backward:
            loss.backward()
    model.eval()
    detached = [lp.detach() for lp in logp_B_T]
    metrics = {"loss": float(loss.detach())} | loss_metrics(detached, sampler_B_T, w_B_T,
                                                   [e.detach() for e in ent_B_T], cfg)
    return ForwardBackwardOutput(float(loss.detach()), metrics, [lp.tolist() for lp in detached])


def _optim_step(host: ModelHost, adam: AdamParams) -> OptimStepOutput:
    _with_trainer_weights(host)
    params = list(host.trainable().values())
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


class SamplingClient:
    """Samples from one frozen weights version of the policy."""

    def __init__(self, session: Session, version: int) -> None:
        self._session, self.version = session, version

    def _submit(self, fn: Callable[[ModelHost], Any]) -> Future:
        def run(host: ModelHost) -> Any:
            _use_version(host, self.version)
            return fn(host)
        return self._session.submit(run)

    def sample(self, prompt: Stream, num_samples: int, sampling_params: SamplingParams,
               seed: int = 0) -> Future:
        """num_samples replies to `prompt` -> Future[SampleResponse]."""
        return self._submit(lambda h: _sample(h, prompt, num_samples, sampling_params, seed))

    def compute_logprobs(self, prompt: Stream, temperature: float = 1.0) -> Future:
        """Per-token log-probs of the prompt's own tokens -> Future[list[float]] (first is 0)."""
        return self._submit(lambda h: _compute_logprobs(h, prompt, temperature))

    def rollout(self, config: MazeConfig, init_states_P: list[InitState], n: int,
                params: SamplingParams, seed: int) -> Future:
        """Play n episodes per maze beside the sampler -> Future[episodes_P_G]."""
        return self._submit(lambda h: _rollout(h, config, init_states_P, n, params, seed))


class TrainingClient:
    """The trainer side of a session: forward/backward, optimiser, state, sampler weights."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def forward(self, datums: list[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: LossConfig | None = None) -> Future:
        """Loss and trainer log-probs without gradients -> Future[ForwardBackwardOutput]."""
        cfg = loss_fn_config or LossConfig()
        return self._session.submit(lambda h: _forward(h, datums, loss_fn, cfg, backward=False))

    def forward_backward(self, datums: list[Datum], loss_fn: str,
                         loss_fn_config: LossConfig | None = None) -> Future:
        """Accumulate gradients of the loss -> Future[ForwardBackwardOutput]."""
        cfg = loss_fn_config or LossConfig()
        return self._session.submit(lambda h: _forward(h, datums, loss_fn, cfg, backward=True))

    def optim_step(self, adam: AdamParams) -> Future:
        """Clip, step AdamW with `adam`, zero the grads -> Future[OptimStepOutput]."""
        return self._session.submit(lambda h: _optim_step(h, adam))

    def save_state(self, name: str) -> Future:
        """Weights + optimiser to workdir/states/<name> (atomic) -> Future[path]."""
        return self._session.submit(
            lambda h: str(checkpoint.save_state(h, h.workdir / "states" / name)))

    def save_state_to(self, folder: str | Path) -> Future:
        """Weights + optimiser to an explicit folder (atomic) -> Future[path]."""
        return self._session.submit(lambda h: str(checkpoint.save_state(h, Path(folder))))

    def load_state(self, path: str | Path, with_optimizer: bool = True) -> Future:
        """Restore weights (and the optimiser) from a saved state -> Future[None]."""
        return self._session.submit(lambda h: checkpoint.load_state(h, Path(path), with_optimizer))

    def load_adapter(self, folder: str | Path) -> Future:
        """Load an exported PEFT adapter (same base model only) -> Future[None]."""
        return self._session.submit(lambda h: checkpoint.load_adapter_weights(h, Path(folder)))

    def save_weights_for_sampler(self, name: str) -> Future:
        """Export the adapter in PEFT format to workdir/sampler_weights/<name> -> Future[path]."""
        folder = self._session.workdir / "sampler_weights" / name
        return self._session.submit(lambda h: str(checkpoint.export_adapter(h, folder)))

    def export_adapter(self, folder: str | Path) -> Future:
        """Export the adapter in PEFT format to `folder` -> Future[path]."""
        return self._session.submit(lambda h: str(checkpoint.export_adapter(h, Path(folder))))

    def export_model(self, folder: str | Path) -> Future:
        """A complete checkpoint folder (LoRA merged in) that load_model reads -> Future[path]."""
        return self._session.submit(lambda h: str(checkpoint.export_model(h, Path(folder))))

    def save_weights_and_get_sampling_client(self) -> SamplingClient:
        """Snapshot the current weights as a sampler version and return its client."""
        return SamplingClient(self._session, self._session.submit(_save_version).result())

    def get_tokenizer(self) -> Any:
        """The policy's tokenizer."""
        return self._session.host.lm.processor.tokenizer

    def get_processor(self) -> Any:
        """The policy's processor (tokenizer + image processor)."""
        return self._session.host.lm.processor


class Session:
    """An in-process session: one model host and the thread that runs its calls in order."""

    recoverable_errors: tuple[type[BaseException], ...] = ()  # nothing to reopen in-process

    def __init__(self, host: ModelHost) -> None:
        self.host = host
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="workbench-session")
        self.training_client = TrainingClient(self)

    @property
    def workdir(self) -> Path:
        return self.host.workdir

    def submit(self, fn: Callable[[ModelHost], Any]) -> Future:
        """Queue fn(host) behind every call submitted before it."""
        return self._pool.submit(fn, self.host)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def report_metrics(self, row: dict[str, Any], run: str) -> Future:
        """Nothing to report to in-process (on Ray: Ray's metrics) -> Future[0]."""
        done: Future = Future()
        done.set_result(0)
        return done

    def describe(self) -> dict[str, Any]:
        """Model source, base hash, LoRA settings (for manifests)."""
        return describe_host(self.host)


def make_host(
    model: str = "tiny",
    lora: LoraSettings | None = LoraSettings(),
    workdir: str | Path = "runs/session",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    hash_weights: bool = True,
    engine: EngineSettings = EngineSettings(),
) -> ModelHost:
    """Load the base, hash it (a sampler-only host may skip that), wrap it in LoRA (None: train
    all weights), make the optimiser and the sampler engine (`engine.name`: generator.engine)."""
    lm = load_model(model, dtype=dtype, device=device)
    base_hash = weights_hash(lm.model) if hash_weights else ""
    if lora is not None:
        lm.model = add_lora(lm.model, lora).eval()
    params = [p for p in lm.model.parameters() if p.requires_grad]
    adapters = Path(workdir) / "sampler_adapters" / str(os.getpid())  # one folder per process
    return ModelHost(
        lm=lm, fmt=chat_format(lm.processor), lora=lora, base_hash=base_hash,
        # fused: one kernel over all parameters, 14x faster than the per-tensor loop on 2 cores
        workdir=Path(workdir), optimizer=torch.optim.AdamW(params, lr=1e-4, fused=True),
        engine=make_engine(engine, lm, lora.rank if lora else None, adapters),
    )


def describe_host(host: ModelHost) -> dict[str, Any]:
    """Model source, base hash, LoRA settings (for manifests)."""
    lora = asdict(host.lora) if host.lora else None
    return {"model": host.lm.source, "model_path": host.lm.path,
            "base_weights_sha256": host.base_hash, "lora": lora}


def create_session(
    model: str = "tiny",
    lora: LoraSettings | None = LoraSettings(),
    workdir: str | Path = "runs/session",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    engine: EngineSettings = EngineSettings(),
) -> Session:
    """Load the base, hash it, wrap it in LoRA (None: train all weights), build the sampler
    engine (default: transformers), start the worker."""
    return Session(make_host(model, lora, workdir, dtype, device, engine=engine))


def create_session_from_state(path: str | Path, with_optimizer: bool = True,
                              **kwargs: Any) -> Session:
    """A session resumed from a saved state (weights and, by default, optimiser)."""
    meta = json.loads((Path(path) / checkpoint.SESSION_FILE).read_text())
    lora = None if meta["lora"] is None else LoraSettings(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in meta["lora"].items()})
    session = create_session(model=meta["model"], lora=lora, **kwargs)
    session.training_client.load_state(path, with_optimizer).result()
    return session
