"""The task registry: name -> (config class, initial states of training and evaluation).

    task = TASKS["room"].config(size=5)
    states = TASKS["room"].train_states(5, 0, 8)

Adding a task: its config and environment in `envs/` (following `envs.protocol`) and one entry
here. The session, both backends and the episode loop stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workbench.envs.env import MazeConfig
from workbench.envs.evalsets import eval_set, train_states
from workbench.envs.room import RoomConfig, room_states

EVAL_OFFSET = 10_000_000  # room evaluation seeds start here, clear of training ones


@dataclass(frozen=True)
class TaskEntry:
    """One task: its config class and how to draw its initial states."""

    config: type
    train_states: Callable[[int, int, int], list[Any]]  # (size, first index, count)
    eval_states: Callable[[int, int], list[Any]]  # (size, count): a fixed set


def _room_eval(size: int, count: int) -> list[Any]:
    return room_states(size, EVAL_OFFSET, count)


TASKS: dict[str, TaskEntry] = {
    "maze": TaskEntry(MazeConfig, train_states, eval_set),
    "room": TaskEntry(RoomConfig, room_states, _room_eval),
}
