"""Fixed evaluation mazes, disjoint training seeds, and the oracle's success ceiling.

The eval set is maze seeds 0-63 (SkyRL's VisGym recipe: 64 seeded rows). Training seeds count
up from 1_000_000, so they never meet an eval seed. `oracle_ceiling` says how many eval mazes a
perfect agent can solve at all within max_turns: on easy (9x9) at 15 turns with VisGym's stop
rule it is 50 of 64, because 14 mazes need 16 moves.

    states = eval_set(9)
    oracle_ceiling(states, max_turns=15, reward_rule="stop_on_goal")  # 50
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from workbench.envs.env import FIRST_TRAIN_SEED, InitState, init_maze, init_state_of
from workbench.envs.maze import make_maze, shortest_path
from workbench.envs.rewards import EXTRA_TURNS

EVAL_SEEDS: range = range(64)
"""Maze seeds of the 64-maze evaluation set."""


def train_seeds(start: int = 0) -> Iterator[int]:
    """Endless maze seeds FIRST_TRAIN_SEED + start, + start + 1, ... (never an eval seed)."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    return itertools.count(FIRST_TRAIN_SEED + start)


def eval_set(size: int | str, n: int = 64) -> list[InitState]:
    """InitStates of the first n eval seeds at this size (n <= len(EVAL_SEEDS))."""
    if not 0 < n <= len(EVAL_SEEDS):
        raise ValueError(f"n must be in 1..{len(EVAL_SEEDS)}, got {n}")
    return [init_state_of(make_maze(size, seed)) for seed in EVAL_SEEDS[:n]]


def shortest_path_lengths(states: list[InitState]) -> list[int]:
    """BFS shortest path (moves) from start to goal for each state."""
    lengths_S = []
    for state in states:
        maze = init_maze(state)
        lengths_S.append(len(shortest_path(maze, maze.start, maze.goal)))
    return lengths_S


def oracle_ceiling(eval_set: list[InitState], max_turns: int, reward_rule: str) -> int:
    """How many mazes an oracle solves within max_turns (the stop rule needs one more turn)."""
    if reward_rule not in EXTRA_TURNS:
        raise ValueError(f"reward_rule must be one of {sorted(EXTRA_TURNS)}, got {reward_rule!r}")
    extra = EXTRA_TURNS[reward_rule]
    return sum(length + extra <= max_turns for length in shortest_path_lengths(eval_set))
