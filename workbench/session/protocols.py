"""The typed surface of a session, the same for every backend (in-process `session.inprocess`,
Ray `cluster.ray_session`). The phases (`rl.phases`), the loop (`rl.train`) and the notebooks are
written against these protocols only. `opener.open_session` returns either backend as a
`SessionLike`, so mypy (`make typecheck`, part of `make test`) checks both against them.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from workbench.policy import SamplingParams, Stream
from workbench.session.host import EpisodeLoop
from workbench.session.losses import LossConfig
from workbench.session.types import AdamParams, Datum


class SamplingClientLike(Protocol):
    """Samples from one frozen weights version."""

    version: int

    def sample(self, prompt: Stream, num_samples: int, sampling_params: SamplingParams,
               seed: int = 0) -> Future: ...

    def compute_logprobs(self, prompt: Stream, temperature: float = 1.0) -> Future: ...

    def play(self, loop: EpisodeLoop, task: Any, init_states_P: list[Any], n: int,
             params: SamplingParams, seed: int) -> Future: ...


class TrainingClientLike(Protocol):
    """The trainer side: gradients, optimiser, states, exports, sampler weights."""

    def forward(self, datums: list[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: LossConfig | None = None) -> Future: ...

    def forward_backward(self, datums: list[Datum], loss_fn: str,
                         loss_fn_config: LossConfig | None = None) -> Future: ...

    def optim_step(self, adam: AdamParams) -> Future: ...

    def grad_squares(self, datums: list[Datum], loss_fn: str,
                     loss_fn_config: LossConfig | None = None) -> Future: ...

    def save_state(self, name: str) -> Future: ...

    def save_state_to(self, folder: str | Path) -> Future: ...

    def load_state(self, path: str | Path, with_optimizer: bool = True) -> Future: ...

    def load_adapter(self, folder: str | Path) -> Future: ...

    def save_weights_for_sampler(self, name: str) -> Future: ...

    def export_adapter(self, folder: str | Path) -> Future: ...

    def export_model(self, folder: str | Path) -> Future: ...

    def save_weights_and_get_sampling_client(self) -> SamplingClientLike: ...

    def get_tokenizer(self) -> Any: ...

    def get_processor(self) -> Any: ...


class SessionLike(Protocol):
    """A live session: its training client, folder, errors it can recover from, metrics."""

    @property
    def training_client(self) -> TrainingClientLike: ...

    @property
    def workdir(self) -> Path: ...

    @property
    def recoverable_errors(self) -> tuple[type[BaseException], ...]: ...

    @property
    def overlaps_sampling(self) -> bool: ...  # sampling runs beside the trainer's calls

    def report_metrics(self, row: dict[str, Any], run: str) -> Future: ...

    def speed_metrics(self) -> Future: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
