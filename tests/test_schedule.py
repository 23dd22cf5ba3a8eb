"""Learning-rate schedules and the data position of a step (pure functions of the step)."""

from __future__ import annotations

import math

import pytest

from workbench.config import PRESETS, apply_overrides
from workbench.envs import EVAL_SEEDS
from workbench.rl.schedule import learning_rate, step_mazes, step_seed


def test_constant_schedule() -> None:
    config = apply_overrides(PRESETS["tiny"], ["trainer.learning_rate=2e-4"])
    assert [learning_rate(config, s) for s in (1, 7, 40)] == [2e-4, 2e-4, 2e-4]


def test_warmup_cosine_schedule() -> None:
    config = apply_overrides(PRESETS["tiny"], [
        "trainer.lr_schedule=warmup_cosine", "trainer.warmup_steps=4",
        "trainer.total_steps=14", "trainer.learning_rate=1e-3"])
    assert learning_rate(config, 1) == pytest.approx(2.5e-4)
    assert learning_rate(config, 4) == pytest.approx(1e-3)
    assert learning_rate(config, 9) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert learning_rate(config, 14) == pytest.approx(0.0, abs=1e-12)


def test_step_mazes_are_a_function_of_the_step_and_never_eval_mazes() -> None:
    config = PRESETS["tiny"]
    first, again = step_mazes(config, 3), step_mazes(config, 3)
    assert [s.maze_seed for s in first] == [s.maze_seed for s in again]
    seeds = {s.maze_seed for step in range(1, 6) for s in step_mazes(config, step)}
    assert len(seeds) == 5 * config.trainer.train_batch_size  # no maze repeats across steps
    assert not seeds & set(EVAL_SEEDS)
    assert step_seed(config, 3) != step_seed(config, 4)
