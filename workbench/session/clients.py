"""The training and sampling clients (Tinker's shape), written once over an executor.

    session = open_session(SessionSpec(model="tiny", lora=LoraSettings(rank=8)))  # opener
    tc = session.training_client
    fb = tc.forward_backward(datums, "ppo")               # returns a future at once
    opt = tc.optim_step(AdamParams(learning_rate=3e-4))   # queued behind forward_backward
    fb.result(), opt.result()
    sampler = tc.save_weights_and_get_sampling_client()   # pinned to these weights
    sampler.sample(prompt_stream, 4, SamplingParams()).result()
    tc.save_state("step1").result()                       # <workdir>/states/step1
    tc.export("step1", "adapter").result()                # <workdir>/exports/step1 (PEFT)

Every call returns a `concurrent.futures.Future`. Each method sends one function of
`session.host` (or `session.checkpoint`) through the session's `Executor`, which decides where
it runs: the in-process session (`session.inprocess`) on its trainer's thread and its sampler's
thread, the Ray session (`cluster.ray_session`) on its trainer workers (the datums split over
them, their gradients summed) and its sampler engines. A new primitive is a host function and
one method here.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from workbench.policy import SamplingParams, Stream
from workbench.session import checkpoint, host
from workbench.session.host import EpisodeLoop, ModelHost
from workbench.session.losses import LossConfig
from workbench.session.types import AdamParams, Datum

Call = Callable[..., Any]  # fn(host, *args): a function of session.host or session.checkpoint
EXPORTS: dict[str, Callable[[ModelHost, Path], Path]] = {
    "adapter": checkpoint.export_adapter,  # PEFT format: PeftModel.from_pretrained, vLLM, serve
    "model": checkpoint.export_model,  # the LoRA merged in: a new base for load_model
}


class Executor(Protocol):
    """Where a client's calls run. Each call is fn(host, *args) on a `ModelHost` and returns a
    Future at once; the calls on one lane run in the order they were submitted. The trainer
    lane holds one or more identical replicas (rank 0 canonical), the sampler lane one or more
    engines."""

    @property
    def workdir(self) -> Path: ...

    def submit(self, fn: Call, *args: Any) -> Future:
        """fn(host, *args) on the trainer (rank 0: saves and exports) -> its result."""
        ...

    def submit_all(self, fn: Call, *args: Any) -> Future:
        """fn(host, *args) on every trainer replica -> rank 0's result."""
        ...

    def submit_batch(self, fn: Call, datums: list[Datum], *args: Any) -> Future:
        """fn(host, datums_slice, *args) on every replica, each on its slice of the datums ->
        the result one replica gives for all of them: forward outputs merged, anything else
        rank 0's (fn sums the gradients over the replicas before it reads them)."""
        ...

    def submit_sampling(self, fn: Call, *args: Any, model: bool = False) -> Future:
        """fn(host, *args) on the sampler (engine 0). model: fn runs the policy model's own
        forward, not the sampler engine."""
        ...

    def submit_spread(self, fn: Call, items: list[Any], *args: Any, seed: int) -> Future:
        """fn(host, chunk, *args, seed_k) on each engine, the items split in contiguous chunks
        (chunk 0 keeps `seed`) -> the engines' lists concatenated in item order."""
        ...

    def sync_weights(self) -> int:
        """The trainer's current weights as a new sampler version on every engine -> the
        version (once every engine has it)."""
        ...


class SamplingClient:
    """Samples from one frozen weights version of the policy."""

    def __init__(self, executor: Executor, version: int) -> None:
        self._executor, self.version = executor, version

    def sample(self, prompt: Stream, num_samples: int, sampling_params: SamplingParams,
               seed: int = 0) -> Future:
        """num_samples replies to `prompt` -> Future[SampleResponse]."""
        return self._executor.submit_sampling(host.sample, self.version, prompt, num_samples,
                                              sampling_params, seed)

    def compute_logprobs(self, prompt: Stream, temperature: float = 1.0) -> Future:
        """Per-token log-probs of the prompt's own tokens -> Future[list[float]] (first is 0)."""
        return self._executor.submit_sampling(host.compute_logprobs, self.version, prompt,
                                              temperature, model=True)

    def play(self, loop: EpisodeLoop, task: Any, init_states_P: list[Any], n: int,
             params: SamplingParams, seed: int) -> Future:
        """loop(...) beside the sampler: n episodes per initial state of `task` (any
        environment of `envs.protocol`; the loop is `rl.rollout.play_episodes`), the states
        split over the engines (chunk k sampled with seed `cluster.ray_session.chunk_seed(seed,
        k)`) -> Future[episodes_P_G]."""
        return self._executor.submit_spread(host.play, list(init_states_P), self.version, loop,
                                            task, n, params, seed=seed)


class TrainingClient:
    """The trainer side: forward/backward, optimiser, states, exports, sampler weights."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._processor: Any = None

    def forward(self, datums: list[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: LossConfig | None = None) -> Future:
        """Loss and trainer log-probs without gradients -> Future[ForwardBackwardOutput]."""
        host.warn_if_empty("forward", datums)
        return self._executor.submit_batch(host.forward, datums, loss_fn,
                                           loss_fn_config or LossConfig(), False)

    def forward_backward(self, datums: list[Datum], loss_fn: str,
                         loss_fn_config: LossConfig | None = None) -> Future:
        """Accumulate gradients of the loss -> Future[ForwardBackwardOutput]; no datums: a
        RuntimeWarning and an output marked empty."""
        host.warn_if_empty("forward_backward", datums)
        return self._executor.submit_batch(host.forward, datums, loss_fn,
                                           loss_fn_config or LossConfig(), True)

    def optim_step(self, adam: AdamParams) -> Future:
        """Sum the gradients over the replicas, clip, step AdamW with `adam`, zero the grads
        -> Future[OptimStepOutput]."""
        return self._executor.submit_all(host.optim_step, adam)

    def grad_squares(self, datums: list[Datum], loss_fn: str,
                     loss_fn_config: LossConfig | None = None) -> Future:
        """Squared gradient norm of each trainable parameter for these datums, without
        stepping (gradients accumulated before are dropped too) -> Future[dict[str, float]]."""
        return self._executor.submit_batch(host.grad_squares, datums, loss_fn,
                                           loss_fn_config or LossConfig())

    def save_state(self, path: str | Path) -> Future:
        """Weights + optimiser, atomically, to `path`: a name (a string without a folder)
        goes under the workdir's states/, anything else is the folder -> Future[path]."""
        return self._executor.submit(_written, checkpoint.save_state, self._folder(path, "states"))

    def load_state(self, path: str | Path, with_optimizer: bool = True) -> Future:
        """Restore weights (and the optimiser) from a saved state -> Future[None]."""
        return self._executor.submit_all(checkpoint.load_state, Path(path), with_optimizer)

    def export(self, path: str | Path, kind: str) -> Future:
        """The trainer's weights for use outside the trainer: kind "adapter" (PEFT format) or
        "model" (a complete checkpoint folder, LoRA merged in, that load_model reads), to
        `path` (a name goes under the workdir's exports/) -> Future[path]."""
        if kind not in EXPORTS:
            raise ValueError(f"unknown export kind {kind!r}; choose one of {sorted(EXPORTS)}")
        return self._executor.submit(_written, EXPORTS[kind], self._folder(path, "exports"))

    def load_adapter(self, folder: str | Path) -> Future:
        """Load an exported PEFT adapter (same base model only) -> Future[None]."""
        return self._executor.submit_all(checkpoint.load_adapter_weights, Path(folder))

    def save_weights_and_get_sampling_client(self) -> SamplingClient:
        """The current weights as a sampler version (on every engine) and its client."""
        return SamplingClient(self._executor, self._executor.sync_weights())

    def get_processor(self) -> Any:
        """The policy's processor (tokenizer + image processor), fetched once."""
        if self._processor is None:
            self._processor = self._executor.submit(operator.attrgetter("lm.processor")).result()
        return self._processor

    def get_tokenizer(self) -> Any:
        """The policy's tokenizer."""
        return self.get_processor().tokenizer

    def _folder(self, path: str | Path, under: str) -> Path:
        """`path` as a folder: a name (a string without a folder part) under workdir/<under>."""
        if path == "":
            raise ValueError("a state or export needs a name or a folder, got ''")
        if isinstance(path, str) and Path(path).name == path:
            return self._executor.workdir / under / path
        return Path(path)


def _written(h: ModelHost, write: Callable[[ModelHost, Path], Path], folder: Path) -> str:
    """write(h, folder), and the folder it wrote as a string (what the futures hand back)."""
    return str(write(h, folder))
