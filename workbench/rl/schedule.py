"""What a GRPO step trains on, as functions of the config and the step: its learning rate, its
mazes and its sampling seed. A resumed or replayed run sees exactly the same data.
"""

from __future__ import annotations

import math

from workbench.config import RunConfig
from workbench.envs import InitState, train_states


def learning_rate(config: RunConfig, step: int) -> float:
    """LR of a 1-based step: constant, or linear warm-up then cosine to zero."""
    a = config.algorithm
    if a.lr_schedule == "constant":
        return a.learning_rate
    if step <= a.warmup_steps:
        return a.learning_rate * step / max(a.warmup_steps, 1)
    progress = (step - a.warmup_steps) / max(config.trainer.total_steps - a.warmup_steps, 1)
    return a.learning_rate * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def step_mazes(config: RunConfig, step: int) -> list[InitState]:
    """The P training mazes of a 1-based step: training mazes (step - 1) * P, ... (plus the
    trainer seed's offset), never a task of the eval set (`envs.train_maze`)."""
    P = config.trainer.train_batch_size
    return train_states(config.env.size, (step - 1) * P + config.trainer.seed * 100_000_000, P)


def step_seed(config: RunConfig, step: int) -> int:
    """Sampling seed of a step."""
    return config.trainer.seed * 1_000_003 + step


REFILL_OFFSET = 20_000_000
"""Training-maze index where the refill mazes of dynamic sampling start (the step mazes start at
0 and SFT's at 50,000,000, each plus the trainer seed's offset)."""


def refill_mazes(config: RunConfig, step: int, round_: int, n: int) -> list[InitState]:
    """The n <= P refill mazes of round `round_` (1-based) of a step (algorithm.dynamic_sampling):
    a block of P training mazes per (step, round), never a task of the eval set."""
    t = config.trainer
    block = (step - 1) * max(config.algorithm.dynamic_sampling, 1) + round_ - 1
    first = REFILL_OFFSET + block * t.train_batch_size + t.seed * 100_000_000
    return train_states(config.env.size, first, n)


def refill_seed(config: RunConfig, step: int, round_: int) -> int:
    """Sampling seed of a refill round (apart from every step's seed)."""
    return step_seed(config, step) + 500_000_000 * round_
