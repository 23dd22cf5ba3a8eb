"""The task registry (`env.task` -> its entry) and the scripted policies that play any task.

    entry = TASKS["room"]
    task = entry.make({"size": 5, "max_turns": 8, ...})   # what RunConfig.task does from env.*
    task.ceiling(entry.eval_states(5, 64))                  # the fixed set and its ceiling

Train, SFT, eval and the scripted baselines draw their states here (`rl.schedule`). Adding a
task: its config and environment in `envs/` (following `envs.protocol`) and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.envs.actions import format_action, move, stop
from workbench.envs.env import MazeConfig, init_maze
from workbench.envs.evalsets import eval_set, train_states
from workbench.envs.maze import Maze, oracle_actions, step_pos
from workbench.envs.rewards import REWARDS
from workbench.envs.room import RoomConfig, RoomEnv, RoomState, room_maze, room_states
from workbench.envs.state import InitState

EVAL_OFFSET = 10_000_000  # room evaluation seeds start here, clear of training ones


@dataclass(frozen=True)
class TaskEntry:
    """One task: its config from env.* settings, its initial states, its reward and the grid
    of a step record's state."""

    make: Callable[[dict[str, Any]], Any]  # env.* settings and max_turns -> an envs.protocol.Task
    train_states: Callable[[int, int, int], list[Any]]  # (size, first index, count)
    eval_states: Callable[[int, int], list[Any]]  # (size, count): a fixed set
    reward: Callable[[Any], Callable[..., Any]]  # task config -> the function that rewards
    recorded_maze: Callable[[dict[str, Any]], Maze]  # a recorded state's to_dict() -> its grid


def _room(settings: dict[str, Any]) -> RoomConfig:
    """The room from env.* settings: it rewards reaching the goal and nothing else."""
    if settings["reward"] != "reach_goal" or settings["format_weight"]:
        raise ValueError(f"the room rewards reaching its goal only: it takes reward=reach_goal "
                         f"and format_weight=0, not {settings['reward']!r} and "
                         f"{settings['format_weight']!r}")
    return RoomConfig(**{k: settings[k] for k in
                         ("size", "px_per_cell", "grammar", "max_turns", "observation")})


TASKS: dict[str, TaskEntry] = {
    "maze": TaskEntry(lambda settings: MazeConfig(**settings), train_states, eval_set,
                      lambda task: REWARDS[task.reward],
                      lambda data: init_maze(InitState.from_dict(data))),
    "room": TaskEntry(_room, room_states, lambda size, n: room_states(size, EVAL_OFFSET, n),
                      lambda task: RoomEnv.step,
                      lambda data: room_maze(RoomState(data["size"], data["start"], data["goal"]))),
}


# A scripted policy picks the next reply text from (grid, position, task config, rng): it plays
# any task here, both being grids (`TaskEnv.maze`), in the config's reply grammar.
ScriptedPolicy = Callable[[Maze, tuple[int, int], Any, np.random.Generator], str]


def random_policy(maze: Maze, pos: tuple[int, int], config: Any,
                  rng: np.random.Generator) -> str:
    """Uniform over the four moves (walls included)."""
    return format_action(move(int(rng.integers(4))), config.grammar)


def random_open_policy(maze: Maze, pos: tuple[int, int], config: Any,
                       rng: np.random.Generator) -> str:
    """Uniform over the moves that do not hit a wall."""
    open_dirs = [d for d in range(4) if step_pos(maze, pos, d) != pos]
    return format_action(move(int(rng.choice(open_dirs))), config.grammar)


def oracle_policy(maze: Maze, pos: tuple[int, int], config: Any,
                  rng: np.random.Generator) -> str:
    """BFS shortest path from here; stop once on the goal."""
    path = oracle_actions(maze, pos)
    return format_action(path[0] if path else stop(), config.grammar)


SCRIPTED: dict[str, ScriptedPolicy] = {
    "random": random_policy,
    "random_open": random_open_policy,
    "oracle": oracle_policy,
}
"""The scripted policies: the baselines (`demo.baselines`) and SFT's oracle (`rl.sft`)."""
