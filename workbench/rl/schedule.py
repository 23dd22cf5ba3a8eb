"""What a GRPO step trains on, as functions of the config and the step: its learning rate, its
states, its sampling seed, and the records the phases take (`step_batch`, `refill_batch`,
`eval_batch`, `step_update`). A resumed or replayed run sees exactly the same data.

    ro = phases.rollout(sampler, step_batch(config, 3))      # step 3's P states x G episodes
    up = phases.update(training_client, datums, step_update(config, 3))
    ev = phases.evaluate(sampler, eval_batch(config))        # the fixed set of env.task

States come from the task registry (`envs.tasks.TASKS[config.env.task]`): the maze's training
mazes are never a task of its eval set (`envs.train_maze`).
"""

from __future__ import annotations

import math
from typing import Any

from workbench.config import RunConfig
from workbench.envs.tasks import TASKS
from workbench.policy import SamplingParams
from workbench.rl.phases import Batch, UpdateSettings
from workbench.session import AdamParams, LossConfig

EVAL_SEED = 12345
"""Sampling seed of every evaluation (the same episodes for the same weights)."""


def learning_rate(config: RunConfig, step: int) -> float:
    """LR of a 1-based step: constant, or linear warm-up then cosine to zero."""
    a = config.algorithm
    if a.lr_schedule == "constant":
        return a.learning_rate
    if step <= a.warmup_steps:
        return a.learning_rate * step / max(a.warmup_steps, 1)
    progress = (step - a.warmup_steps) / max(config.trainer.total_steps - a.warmup_steps, 1)
    return a.learning_rate * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def train_states(config: RunConfig, first: int, count: int) -> list[Any]:
    """Training states first, ..., first + count - 1 of env.task at env.size."""
    return TASKS[config.env.task].train_states(config.env.size, first, count)


def step_mazes(config: RunConfig, step: int) -> list[Any]:
    """The P training states of a 1-based step: training states (step - 1) * P, ... (plus the
    trainer seed's offset); for the maze never a task of the eval set (`envs.train_maze`)."""
    P = config.trainer.train_batch_size
    return train_states(config, (step - 1) * P + config.trainer.seed * 100_000_000, P)


def step_seed(config: RunConfig, step: int) -> int:
    """Sampling seed of a step."""
    return config.trainer.seed * 1_000_003 + step


REFILL_OFFSET = 20_000_000
"""Training-maze index where the refill mazes of dynamic sampling start (the step mazes start at
0 and SFT's at 50,000,000, each plus the trainer seed's offset)."""


def refill_mazes(config: RunConfig, step: int, round_: int, n: int) -> list[Any]:
    """The n <= P refill states of round `round_` (1-based) of a step (algorithm.dynamic_sampling):
    a block of P training states per (step, round), for the maze never a task of the eval set."""
    t = config.trainer
    block = (step - 1) * max(config.algorithm.dynamic_sampling, 1) + round_ - 1
    return train_states(config, REFILL_OFFSET + block * t.train_batch_size
                        + t.seed * 100_000_000, n)


def refill_seed(config: RunConfig, step: int, round_: int) -> int:
    """Sampling seed of a refill round (apart from every step's seed)."""
    return step_seed(config, step) + 500_000_000 * round_


def _batch(config: RunConfig, states: list[Any], seed: int) -> Batch:
    g = config.generator
    params = SamplingParams(max_tokens=g.max_tokens, temperature=g.temperature)
    return Batch(config.task, states, g.n_samples_per_prompt, params, seed, g.history_images)


def step_batch(config: RunConfig, step: int) -> Batch:
    """What step `step` rolls out: its states, G = generator.n_samples_per_prompt, the
    generator's sampling parameters and image window, the step's seed."""
    return _batch(config, step_mazes(config, step), step_seed(config, step))


def refill_batch(config: RunConfig, step: int, round_: int, n: int) -> Batch:
    """What refill round `round_` of a step rolls out (n states: `refill_mazes`)."""
    return _batch(config, refill_mazes(config, step, round_, n), refill_seed(config, step, round_))


def eval_batch(config: RunConfig) -> Batch:
    """The fixed set of env.task: eval.n_mazes states, G = eval.sampled_passes at
    eval.temperature (`phases.evaluate` adds the greedy pass), seed EVAL_SEED."""
    e, g = config.eval, config.generator
    states = TASKS[config.env.task].eval_states(config.env.size, e.n_mazes)
    params = SamplingParams(max_tokens=g.max_tokens, temperature=e.temperature)
    return Batch(config.task, states, e.sampled_passes, params, EVAL_SEED, g.history_images)


def step_update(config: RunConfig, step: int) -> UpdateSettings:
    """How step `step` updates: algorithm.loss with its clip range and reduction (log-probs at
    generator.temperature), AdamW at the step's learning rate, the algorithm's mini-batching."""
    a = config.algorithm
    loss = LossConfig(clip_low=a.clip_low, clip_high=a.clip_high, reduction=a.loss_reduction,
                      temperature=config.generator.temperature, tis_cap=a.tis_cap)
    adam = AdamParams(learning_rate=learning_rate(config, step), grad_clip_norm=a.grad_clip_norm)
    return UpdateSettings(a.loss, loss, adam, a.minibatch, a.mini_batches, a.update_epochs)
