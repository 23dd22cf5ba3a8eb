"""Shared fixtures: the tiny Qwen3-VL built once per session into a temporary cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def workbench_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """$WORKBENCH_CACHE points at a session temp dir, so no test touches ~/.cache."""
    root = tmp_path_factory.mktemp("workbench-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBENCH_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def tiny_dir(workbench_cache: Path) -> Path:
    """The tiny default's checkpoint folder, built once under the session cache."""
    from workbench.model import tiny_path

    return tiny_path()


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path):
    """The tiny default loaded from its folder (a LoadedModel; do not mutate its weights)."""
    from workbench.model import load_model

    return load_model(str(tiny_dir))
