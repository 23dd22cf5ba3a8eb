"""What the episode loop needs from a task: the seam between `rl.rollout` and `envs`.

A task is a frozen, picklable config (it travels to Ray sampler engines) that makes environments
and states the rules; an environment takes reply text and answers with an observation. The
session never sees either: it runs the loop it is handed (`session.host.play`). `MazeConfig` /
`MazeEnv` are the main task; `RoomConfig` / `RoomEnv` (envs/room.py) a second, small one. A new
task adds its module here and one entry to `envs.tasks.TASKS` (`env.task` picks it). Both are
grids: an environment shows its `maze`, which the scripted policies read.
"""

from __future__ import annotations

from typing import Any, Protocol

from workbench.envs.maze import Maze


class TaskEnv(Protocol):
    """One episode at a time, Gymnasium-style, with reply text as the action.

    Observations carry "image" (uint8 H x W x 3) and "text" (the same view as text); `info`
    carries "feedback" (text for the model, "" at reset) and "budget_text" (the turn counter),
    and after a step also "action" (the parsed `envs.Action`) and "success"."""

    @property
    def pos(self) -> tuple[int, int]:
        """The agent's (row, col): what the trajectory viewers and turn metrics follow."""
        ...

    @property
    def done(self) -> bool:
        """True once the episode terminated or was truncated."""
        ...

    @property
    def maze(self) -> Maze:
        """The grid of the episode since the last reset: walls, start and goal."""
        ...

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode; options["init_state"] replays a recorded initial state exactly."""
        ...

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """One reply: (observation, reward, terminated, truncated, info)."""
        ...


class Task(Protocol):
    """A task config: makes environments, states the rules, says what the model is shown."""

    # read-only (properties): a task is a frozen dataclass, whose fields a Protocol's plain
    # attributes (settable) would not match
    @property
    def max_turns(self) -> int:
        """Replies an episode may take."""
        ...

    @property
    def observation(self) -> str:
        """What the model is shown: "image" | "ascii"."""
        ...

    def make_env(self) -> TaskEnv:
        """A fresh environment of this task."""
        ...

    def rules(self) -> str:
        """The system prompt: goal, what the model sees, the reply grammar, the turn limit."""
        ...

    def ceiling(self, states: list[Any]) -> int:
        """How many of these initial states an oracle solves within the turn budget: what a
        success rate is read against (`rl.evaluate.summarize`)."""
        ...
