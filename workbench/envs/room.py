"""A second, small task: an open room (walls only around the edge), walk to the goal.

It keeps the seam honest: it follows `envs.protocol`, plays through the same session, loop and
phases as the maze with no change outside `envs/`, and trains from the command line
(`python -m workbench train env.task=room`; tests/test_tasks.py).

    env = RoomConfig(size=5).make_env()
    obs, info = env.reset(options={"init_state": RoomState(5, start=(1, 1), goal=(3, 3))})
    obs, reward, terminated, truncated, info = env.step("down")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from workbench.envs.actions import parse_action
from workbench.envs.env import FEEDBACK_OK, FEEDBACK_WALL, budget_text, rules_text
from workbench.envs.maze import Maze, render_ascii, render_image, shortest_path, step_pos


@dataclass(frozen=True)
class RoomState:
    """What a room episode starts from."""

    size: int  # cells per side incl. the edge walls
    start: tuple[int, int]  # (row, col) of the agent
    goal: tuple[int, int]  # (row, col) of the goal
    seed: int = 0  # the room index it was drawn from (room_states)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (a step record's episodes)."""
        return {"size": self.size, "start": list(self.start), "goal": list(self.goal),
                "seed": self.seed}


def room_states(size: int, first: int, count: int) -> list[RoomState]:
    """`count` rooms with seeded start and goal (distinct cells), rooms first..first+count-1."""
    cells = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
    out = []
    for index in range(first, first + count):
        a, b = np.random.default_rng(index).choice(len(cells), size=2, replace=False)
        out.append(RoomState(size, cells[int(a)], cells[int(b)], index))
    return out


@dataclass(frozen=True)
class RoomConfig:
    """The room task: side, pixels per cell, reply grammar, turn budget."""

    size: int = 5
    px_per_cell: int = 16
    grammar: str = "keyword"
    max_turns: int = 8
    observation: str = "image"

    def __post_init__(self) -> None:
        if self.size < 4:
            raise ValueError(f"a room needs size >= 4 (two cells inside its walls), got "
                             f"{self.size}")

    def make_env(self) -> RoomEnv:
        return RoomEnv(self)

    def rules(self) -> str:
        """The system prompt, in the maze's words (`envs.env.rules_text`) for this grammar."""
        return rules_text(f"You are in an empty {self.size}x{self.size} room.",
                          self.observation, "reach_goal", self.grammar, self.max_turns)

    def ceiling(self, states: list[RoomState]) -> int:
        """Rooms whose goal is at most max_turns moves away (every room can be crossed)."""
        return sum(len(shortest_path(room_maze(s), s.start, s.goal)) <= self.max_turns
                   for s in states)


def room_maze(state: RoomState) -> Maze:
    """The room as a Maze (edge walls only), for stepping and drawing."""
    walls_HW = np.zeros((state.size, state.size), dtype=bool)
    walls_HW[0, :] = walls_HW[-1, :] = walls_HW[:, 0] = walls_HW[:, -1] = True
    return Maze(walls_HW, state.start, state.goal, seed=-1)


class RoomEnv:
    """One room episode per reset; reward 1.0 on reaching the goal."""

    def __init__(self, config: RoomConfig) -> None:
        self.config = config
        self._maze: Maze | None = None
        self._pos, self._turn, self._done = (0, 0), 0, False

    @property
    def pos(self) -> tuple[int, int]:
        return self._pos

    @property
    def done(self) -> bool:
        return self._done

    @property
    def maze(self) -> Maze:
        if self._maze is None:
            raise RuntimeError("call reset() first")
        return self._maze

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        state = (options or {}).get("init_state") or room_states(self.config.size, seed or 0, 1)[0]
        self._maze = room_maze(state)
        self._pos, self._turn, self._done = state.start, 0, False
        return self._observation(), {"feedback": "", "success": False,
                                     "budget_text": budget_text(0, self.config.max_turns)}

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        if self._maze is None or self._done:
            raise RuntimeError("call reset() first")
        parsed = parse_action(action, self.config.grammar) if isinstance(action, str) else action
        before = self._pos
        if parsed.kind == "move":
            self._pos = step_pos(self._maze, before, parsed.direction or 0)
        feedback = parsed.error if not parsed.valid else (
            FEEDBACK_WALL if parsed.kind == "move" and self._pos == before else FEEDBACK_OK)
        self._turn += 1
        terminated = self._pos == self._maze.goal
        truncated = not terminated and self._turn >= self.config.max_turns
        self._done = terminated or truncated
        info = {"feedback": feedback, "action": parsed, "success": terminated,
                "budget_text": "" if self._done else budget_text(self._turn,
                                                                  self.config.max_turns)}
        return self._observation(), float(terminated), terminated, truncated, info

    def _observation(self) -> dict[str, Any]:
        assert self._maze is not None
        return {"image": render_image(self._maze, self._pos, self.config.px_per_cell),
                "text": render_ascii(self._maze, self._pos), "pos": self._pos}
