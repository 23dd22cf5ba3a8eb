"""Learning-rate schedules and the data position of a step (pure functions of the step)."""

from __future__ import annotations

import math

import pytest

from workbench.config import PRESETS, apply_overrides
from workbench.envs import EVAL_SEEDS, eval_set
from workbench.policy import SamplingParams
from workbench.rl.phases import Batch, UpdateSettings
from workbench.rl.schedule import (
    EVAL_SEED,
    eval_batch,
    learning_rate,
    refill_batch,
    refill_mazes,
    refill_seed,
    step_batch,
    step_mazes,
    step_seed,
    step_update,
)
from workbench.session import AdamParams, LossConfig


def test_constant_schedule() -> None:
    config = apply_overrides(PRESETS["tiny"], ["algorithm.learning_rate=2e-4"])
    assert [learning_rate(config, s) for s in (1, 7, 40)] == [2e-4, 2e-4, 2e-4]


def test_warmup_cosine_schedule() -> None:
    config = apply_overrides(PRESETS["tiny"], [
        "algorithm.lr_schedule=warmup_cosine", "algorithm.warmup_steps=4",
        "trainer.total_steps=14", "algorithm.learning_rate=1e-3"])
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


def test_refill_mazes_are_their_own_block_per_step_and_round() -> None:
    """Dynamic sampling's refill mazes (algorithm.dynamic_sampling) depend only on the step and
    round, never repeat a step maze or another round's, and are held out from the eval set."""
    from workbench.envs import eval_task_keys, init_maze, task_key

    config = apply_overrides(PRESETS["tiny"], ["algorithm.dynamic_sampling=2"])
    P = config.trainer.train_batch_size
    blocks = {(step, r): [s.maze_seed for s in refill_mazes(config, step, r, P)]
              for step in (1, 2, 3) for r in (1, 2)}
    assert blocks[(2, 1)] == [s.maze_seed for s in refill_mazes(config, 2, 1, P)]
    assert [s.maze_seed for s in refill_mazes(config, 2, 1, 3)] == blocks[(2, 1)][:3]
    seeds = [seed for block in blocks.values() for seed in block]
    steps = {s.maze_seed for step in range(1, 4) for s in step_mazes(config, step)}
    assert len(set(seeds)) == len(seeds) == 6 * P and not set(seeds) & steps
    held = eval_task_keys(config.env.size)
    assert not {task_key(init_maze(s)) for step, r in blocks
                for s in refill_mazes(config, step, r, P)} & held
    assert len({refill_seed(config, 2, r) for r in (1, 2)} | {step_seed(config, 2)}) == 3


def test_sft_cosine_schedule() -> None:
    from workbench.rl.sft import sft_lr
    from workbench.session import AdamParams

    adam = AdamParams(learning_rate=1e-3)
    assert sft_lr(adam, "constant", 7, 10) is adam
    lrs = [sft_lr(adam, "cosine", s, 10).learning_rate for s in range(1, 11)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[5] == pytest.approx(5e-4)
    assert all(a > b > 0 for a, b in zip(lrs, lrs[1:]))


def test_the_batches_and_update_of_a_step_come_from_the_config() -> None:
    config = apply_overrides(PRESETS["tiny"], [
        "generator.n_samples_per_prompt=4", "generator.temperature=0.9", "generator.max_tokens=3",
        "generator.history_images=2", "eval.n_mazes=5", "eval.sampled_passes=3",
        "eval.temperature=0.6", "algorithm.loss=cispo", "algorithm.clip_high=0.3",
        "algorithm.loss_reduction=token_mean", "algorithm.learning_rate=2e-4",
        "algorithm.minibatch=4",
        "algorithm.mini_batches=2", "algorithm.update_epochs=3", "algorithm.grad_clip_norm=0.5"])
    sampling = SamplingParams(max_tokens=3, temperature=0.9)
    assert step_batch(config, 2) == Batch(config.task, step_mazes(config, 2), 4, sampling,
                                          step_seed(config, 2), history_images=2)
    assert refill_batch(config, 2, 1, 3) == Batch(config.task, refill_mazes(config, 2, 1, 3), 4,
                                                  sampling, refill_seed(config, 2, 1), 2)
    assert eval_batch(config) == Batch(config.task, eval_set(9, 5), 3, SamplingParams(
        max_tokens=3, temperature=0.6), EVAL_SEED, history_images=2)
    assert step_update(config, 2) == UpdateSettings(
        "cispo", LossConfig(clip_high=0.3, reduction="token_mean", temperature=0.9),
        AdamParams(learning_rate=2e-4, grad_clip_norm=0.5), minibatch=4, mini_batches=2,
        epochs=3)


def test_the_tiny_presets_update_is_update_settings_defaults() -> None:
    """The README's step calls update(tc, datums): the same update as the loop's first step."""
    assert step_update(PRESETS["tiny"], 1) == UpdateSettings()
