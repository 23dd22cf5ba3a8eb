"""What a maze episode starts from (`InitState`), and where training mazes start."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from workbench.envs.maze import Maze, make_maze

FIRST_TRAIN_SEED = 1_000_000
"""Training maze index i starts from seed FIRST_TRAIN_SEED + i (evalsets.train_maze), clear of
the eval seeds; reset() without a seed draws a random training index."""


@dataclass(frozen=True)
class InitState:
    """What an episode starts from; enough to replay it exactly."""

    maze_seed: int
    """Seed of make_maze (the walls)."""
    size: int
    """Cells per side incl. the outer wall."""
    start: tuple[int, int]
    """(row, col) of the agent at reset."""
    goal: tuple[int, int]
    """(row, col) of the goal."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", (int(self.start[0]), int(self.start[1])))
        object.__setattr__(self, "goal", (int(self.goal[0]), int(self.goal[1])))

    @property
    def seed(self) -> int:
        """The seed it was drawn from (its maze's): what anything drawn per state is seeded by,
        such as SFT's detours (`rl.sft.sft_steps`)."""
        return self.maze_seed

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict."""
        return {"maze_seed": self.maze_seed, "size": self.size,
                "start": list(self.start), "goal": list(self.goal)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InitState:
        """Inverse of to_dict (lists from JSON become tuples)."""
        return cls(maze_seed=int(data["maze_seed"]), size=int(data["size"]),
                   start=tuple(data["start"]), goal=tuple(data["goal"]))


def init_state_of(maze: Maze) -> InitState:
    """The InitState that rebuilds this maze."""
    return InitState(maze_seed=maze.seed, size=maze.size, start=maze.start, goal=maze.goal)


def init_maze(state: InitState) -> Maze:
    """The maze an InitState describes: make_maze's walls with the recorded start and goal."""
    maze = make_maze(state.size, state.maze_seed)
    return dataclasses.replace(maze, start=state.start, goal=state.goal)
