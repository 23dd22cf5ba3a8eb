"""The session a run holds, the same for both backends (in-process `session.inprocess`, Ray
`cluster.ray_session`). The loop (`rl.train`) and the openers are written against it;
`opener.open_session` returns either backend as a `SessionLike`, so mypy (`make typecheck`,
part of `make test`) checks both against it. The clients' own seam is `clients.Executor`.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from workbench.session.clients import TrainingClient


class SessionLike(Protocol):
    """A live session: its training client, folder, errors it can recover from, metrics."""

    @property
    def training_client(self) -> TrainingClient: ...

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
