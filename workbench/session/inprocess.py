"""The training-session primitives (Tinker's shape), in-process backend.

    session = create_session(SessionSpec(model="tiny", lora=LoraSettings(rank=8)))
    tc = session.training_client
    fb = tc.forward_backward(datums, "ppo")          # returns a future at once
    opt = tc.optim_step(AdamParams(learning_rate=3e-4))  # queued behind forward_backward
    fb.result(), opt.result()
    sampler = tc.save_weights_and_get_sampling_client()
    sampler.sample(prompt_stream, 4, SamplingParams()).result()

Every call returns a `concurrent.futures.Future`. All calls that touch the model run on one
worker thread in submission order, so a forward_backward and an optim_step may both be submitted
before either is awaited. A SamplingClient is bound to the weights version it was created with:
it swaps that LoRA snapshot in for its calls and the trainer's weights back afterwards. With
vLLM (an engine with weights of its own) its `sample` and `play` instead run in order on a
second thread, from the version's snapshot, so a rollout can run while the trainer updates
(`algorithm.off_policy_steps=1`); `compute_logprobs` (the model's own forward) stays on the first.

The behaviour is the public functions of `session.host`; the Ray backend (`workbench.cluster`)
runs the same functions inside its trainer and sampler actors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from workbench.model import LoraSettings
from workbench.policy import SamplingParams, Stream
from workbench.session import checkpoint, host
from workbench.session.host import EpisodeLoop, ModelHost
from workbench.session.losses import LossConfig
from workbench.session.spec import SessionSpec
from workbench.session.types import AdamParams, Datum


class SamplingClient:
    """Samples from one frozen weights version of the policy."""

    def __init__(self, session: Session, version: int) -> None:
        self._session, self.version = session, version

    def _submit(self, fn: Callable[[ModelHost], Any]) -> Future:
        def run(h: ModelHost) -> Any:
            host.use_version(h, self.version)
            return fn(h)
        return self._session.submit_sampling(run)

    def sample(self, prompt: Stream, num_samples: int, sampling_params: SamplingParams,
               seed: int = 0) -> Future:
        """num_samples replies to `prompt` -> Future[SampleResponse]."""
        return self._submit(lambda h: host.sample(h, prompt, num_samples, sampling_params, seed))

    def compute_logprobs(self, prompt: Stream, temperature: float = 1.0) -> Future:
        """Per-token log-probs of the prompt's own tokens -> Future[list[float]] (first is 0)."""
        v = self.version  # the model's own forward: on the trainer's lane
        return self._session.submit(lambda h: host.compute_logprobs(h, v, prompt, temperature))

    def play(self, loop: EpisodeLoop, task: Any, init_states_P: list[Any], n: int,
             params: SamplingParams, seed: int) -> Future:
        """loop(...) beside the sampler: n episodes per initial state of `task` (any
        environment of `envs.protocol`; the loop is `rl.rollout.play_episodes`)
        -> Future[episodes_P_G]."""
        return self._submit(lambda h: host.play(h, loop, task, init_states_P, n, params, seed))


class TrainingClient:
    """The trainer side of a session: forward/backward, optimiser, state, sampler weights."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def forward(self, datums: list[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: LossConfig | None = None) -> Future:
        """Loss and trainer log-probs without gradients -> Future[ForwardBackwardOutput]."""
        cfg = loss_fn_config or LossConfig()
        host.warn_if_empty("forward", datums)
        return self._session.submit(lambda h: host.forward(h, datums, loss_fn, cfg, backward=False))

    def forward_backward(self, datums: list[Datum], loss_fn: str,
                         loss_fn_config: LossConfig | None = None) -> Future:
        """Accumulate gradients of the loss -> Future[ForwardBackwardOutput]; no datums: a
        RuntimeWarning and an output marked empty."""
        cfg = loss_fn_config or LossConfig()
        host.warn_if_empty("forward_backward", datums)
        return self._session.submit(lambda h: host.forward(h, datums, loss_fn, cfg, backward=True))

    def optim_step(self, adam: AdamParams) -> Future:
        """Clip, step AdamW with `adam`, zero the grads -> Future[OptimStepOutput]."""
        return self._session.submit(lambda h: host.optim_step(h, adam))

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
        return SamplingClient(self._session, self._session.submit(host.save_version).result())

    def grad_squares(self, datums: list[Datum], loss_fn: str,
                     loss_fn_config: LossConfig | None = None) -> Future:
        """Squared gradient norm of each trainable parameter for these datums, without
        stepping (gradients accumulated before are dropped too) -> Future[dict[str, float]]."""
        cfg = loss_fn_config or LossConfig()

        def run(h: ModelHost) -> dict[str, float]:
            host.forward(h, datums, loss_fn, cfg, backward=True)
            squares = host.grad_squares(h)
            host.zero_grads(h)
            return squares
        return self._session.submit(run)

    def get_tokenizer(self) -> Any:
        """The policy's tokenizer."""
        return self._session.host.lm.processor.tokenizer

    def get_processor(self) -> Any:
        """The policy's processor (tokenizer + image processor)."""
        return self._session.host.lm.processor


class Session:
    """An in-process session: one model host and the thread that runs its calls in order. With
    an engine that samples from weights of its own (vLLM), sampling calls run in order on a
    second thread, the sampler lane, beside the trainer's calls (`overlaps_sampling`)."""

    recoverable_errors: tuple[type[BaseException], ...] = ()  # nothing to reopen in-process

    def __init__(self, model_host: ModelHost, spec: SessionSpec | None = None) -> None:
        self.host, self.spec = model_host, spec
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="workbench-session")
        self._sampler_pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="workbench-sampler") \
            if model_host.engine.samples_own_weights else self._pool
        self.training_client = TrainingClient(self)

    @property
    def workdir(self) -> Path:
        return self.host.workdir

    @property
    def overlaps_sampling(self) -> bool:
        """Whether sampling calls run beside the trainer's (a lane of their own)."""
        return self._sampler_pool is not self._pool

    def submit(self, fn: Callable[[ModelHost], Any]) -> Future:
        """Queue fn(host) behind the trainer's calls submitted before it (and every sampling
        call too, unless the session `overlaps_sampling`)."""
        return self._pool.submit(fn, self.host)

    def submit_sampling(self, fn: Callable[[ModelHost], Any]) -> Future:
        """Queue a sampling call fn(host): behind the sampling calls before it, and beside the
        trainer's when the session `overlaps_sampling` (else behind every call)."""
        return self._sampler_pool.submit(fn, self.host)

    def close(self) -> None:
        """Finish the queued calls, then free the sampler engine (vLLM's process and GPU share)."""
        self._sampler_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        host.close(self.host)

    def report_metrics(self, row: dict[str, Any], run: str) -> Future:
        """Nothing to report to in-process (on Ray: Ray's metrics) -> Future[0]."""
        done: Future = Future()
        done.set_result(0)
        return done

    def speed_metrics(self) -> Future:
        """`speed/*` of the host: 1.0 per fast path running, 0.0 per one that fell back
        -> Future[dict[str, float]]."""
        return self.submit_sampling(host.speed_metrics)  # in order with the rollouts

    def describe(self) -> dict[str, Any]:
        """Model source, base hash, LoRA settings (for manifests)."""
        return host.describe_host(self.host)


def create_session(spec: SessionSpec = SessionSpec()) -> Session:
    """Build the host of `spec` in this process (load the base, hash it, wrap it in LoRA, the
    sampler engine, the fast paths) and start its worker thread. `workbench.opener.open_session`
    picks this or the Ray backend from the spec's cluster."""
    return Session(host.make_host(spec), spec)


def create_session_from_state(path: str | Path, with_optimizer: bool = True,
                              spec: SessionSpec = SessionSpec()) -> Session:
    """A session resumed from a saved state (weights and, by default, optimiser): its model and
    LoRA settings come from the state, the rest from `spec`."""
    meta = json.loads((Path(path) / checkpoint.SESSION_FILE).read_text())
    lora = LoraSettings.from_dict(meta["lora"])
    session = create_session(replace(spec, model=meta["model"], lora=lora))
    session.training_client.load_state(path, with_optimizer).result()
    return session
