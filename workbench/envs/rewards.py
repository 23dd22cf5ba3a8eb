"""Maze reward rules (one function each, chosen by name from `REWARDS`) and the format term.

A rule sees one transition, ``(maze, pos_before, action, pos_after)``, and returns
``(task_reward, done)``:

- ``"reach_goal"``: 1.0 the moment a move lands on the goal, and the episode ends there.
  A stop also ends the episode (1.0 only if on the goal, which this rule makes unreachable).
- ``"stop_on_goal"`` (VisGym maze_2d): only a stop ends the episode; 1.0 if the agent stopped on
  the goal, else 0.0. Walking onto the goal ends nothing.

`episode_reward` mixes the episode's task reward with a format term, the fraction of turns whose
reply parsed (SkyRL's VisGym recipe uses format_weight 0.2): ``(1 - w) * task + w * format``.
"""

from __future__ import annotations

from collections.abc import Callable

from workbench.envs.actions import Action
from workbench.envs.maze import Maze

RewardFn = Callable[[Maze, tuple[int, int], Action, tuple[int, int]], tuple[float, bool]]
"""(maze, pos_before, action, pos_after) -> (task_reward, done)."""


def reach_goal(
    maze: Maze, pos_before: tuple[int, int], action: Action, pos_after: tuple[int, int]
) -> tuple[float, bool]:
    """1.0 and done as soon as the agent stands on the goal; a stop ends the episode too."""
    on_goal = pos_after == maze.goal
    return (1.0 if on_goal else 0.0), (on_goal or action.kind == "stop")


def stop_on_goal(
    maze: Maze, pos_before: tuple[int, int], action: Action, pos_after: tuple[int, int]
) -> tuple[float, bool]:
    """VisGym's rule: done only on stop; 1.0 if stopped on the goal, else 0.0."""
    if action.kind != "stop":
        return 0.0, False
    return (1.0 if pos_after == maze.goal else 0.0), True


REWARDS: dict[str, RewardFn] = {"reach_goal": reach_goal, "stop_on_goal": stop_on_goal}
"""Reward rules by name."""

EXTRA_TURNS: dict[str, int] = {"reach_goal": 0, "stop_on_goal": 1}
"""Turns a rule needs beyond the shortest path's moves (the final stop)."""


def format_fraction(n_valid: int, n_turns: int) -> float:
    """Fraction of turns whose reply parsed; 0.0 for an episode with no turns."""
    return n_valid / n_turns if n_turns > 0 else 0.0


def episode_reward(task_reward: float, n_valid: int, n_turns: int, format_weight: float) -> float:
    """(1 - w) * task_reward + w * (n_valid / n_turns), w = format_weight."""
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
    fraction = format_fraction(n_valid, n_turns)
    return (1.0 - format_weight) * task_reward + format_weight * fraction
