"""Seeded 2D mazes as VisGym's maze_2d builds them, plus rendering and a BFS oracle.

`make_maze(size, seed)` reproduces VisGym's draws (gymnasium/envs/maze_2d/maze_2d.py):

1. ``rng = numpy.random.default_rng(seed)`` (what ``gymnasium.utils.seeding.np_random`` makes);
2. ``wilson_seed = rng.integers(2**32)`` seeds a ``random.Random`` that carves the
   (size-2) x (size-2) interior with Wilson's loop-erased random walk: cells sit at even
   interior indices, the first visited cell is popped from the row-major list of unvisited
   cells, each walk starts at a random unvisited cell and redraws ``randint(0, 3)`` over the
   directions (right, down, left, up) until the step stays inside the grid;
3. ``rng.integers(0, 4)`` picks one of four (start, goal) pairs of opposite corners.

So the same seed gives the same walls, start and goal as ``Maze2DEnv(...).reset(seed=seed)``.
Sizes count the outer wall: 9 (easy) has 4x4 junction cells, 11 (hard) 5x5.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from workbench.envs.actions import DIRECTIONS, Action, move

SIZES: dict[str, int] = {"tiny": 5, "small": 7, "easy": 9, "hard": 11}
"""Named maze sizes, counted with the outer wall (easy and hard are VisGym's)."""

DELTAS: tuple[tuple[int, int], ...] = ((0, 1), (-1, 0), (0, -1), (1, 0))
"""(row, col) step for each action direction: right, up, left, down."""

WILSON_STEPS: tuple[tuple[int, int], ...] = ((0, 1), (1, 0), (0, -1), (-1, 0))
"""Direction order of the Wilson walk's randint(0, 3) draws: right, down, left, up."""

FLOOR_RGB = (255, 255, 255)
WALL_RGB = (169, 169, 169)
GOAL_RGB = (255, 0, 0)
AGENT_RGB = (0, 0, 255)


@dataclass(frozen=True, eq=False)
class Maze:
    """A maze with its start and goal; walls_HW is read-only."""

    walls_HW: np.ndarray
    """bool (size, size), True = wall, outer wall included."""
    start: tuple[int, int]
    """(row, col) where the agent starts."""
    goal: tuple[int, int]
    """(row, col) of the red goal cell."""
    seed: int
    """The seed make_maze was called with."""

    def __post_init__(self) -> None:
        walls_HW = np.array(self.walls_HW, dtype=bool)
        walls_HW.setflags(write=False)
        object.__setattr__(self, "walls_HW", walls_HW)
        object.__setattr__(self, "start", (int(self.start[0]), int(self.start[1])))
        object.__setattr__(self, "goal", (int(self.goal[0]), int(self.goal[1])))

    @property
    def size(self) -> int:
        """Side length in cells, outer wall included."""
        return int(self.walls_HW.shape[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Maze):
            return NotImplemented
        return (self.seed, self.start, self.goal) == (other.seed, other.start, other.goal) and (
            bool(np.array_equal(self.walls_HW, other.walls_HW))
        )

    __hash__ = None  # type: ignore[assignment]


def resolve_size(size: int | str) -> int:
    """An odd side length >= 5 from an int or a name in SIZES; ValueError otherwise."""
    value = SIZES.get(size, size) if isinstance(size, str) else size
    if isinstance(value, bool) or not isinstance(value, int) or value < 5 or value % 2 == 0:
        raise ValueError(f"size must be an odd int >= 5 or one of {SIZES}, got {size!r}")
    return value


def wilson_carve(n: int, rng: random.Random) -> np.ndarray:
    """Open cells (True) of an n x n grid carved by Wilson's algorithm; n odd, draws as VisGym."""
    open_NN = np.zeros((n, n), dtype=bool)
    unvisited = [(r, c) for r in range(0, n, 2) for c in range(0, n, 2)]
    first = unvisited.pop(rng.randint(0, len(unvisited) - 1))
    visited = {first}
    open_NN[first] = True
    while unvisited:
        walk_start = unvisited[rng.randint(0, len(unvisited) - 1)]
        exit_dir: dict[tuple[int, int], int] = {}
        cell = walk_start
        while cell not in visited:
            d = rng.randint(0, 3)
            while not _inside(cell, WILSON_STEPS[d], 2, n):
                d = rng.randint(0, 3)
            exit_dir[cell] = d  # overwriting erases loops
            cell = _offset(cell, WILSON_STEPS[d], 2)
        cell = walk_start
        while cell not in visited:
            visited.add(cell)
            unvisited.remove(cell)
            open_NN[cell] = True
            open_NN[_offset(cell, WILSON_STEPS[exit_dir[cell]], 1)] = True
            cell = _offset(cell, WILSON_STEPS[exit_dir[cell]], 2)
    return open_NN


def _offset(cell: tuple[int, int], step: tuple[int, int], k: int) -> tuple[int, int]:
    return (cell[0] + k * step[0], cell[1] + k * step[1])


def _inside(cell: tuple[int, int], step: tuple[int, int], k: int, n: int) -> bool:
    r, c = _offset(cell, step, k)
    return 0 <= r < n and 0 <= c < n


def corner_pairs(size: int) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...]:
    """VisGym's four (start, goal) pairs of opposite corners, in its order."""
    lo, hi = 1, size - 2
    return (((lo, lo), (hi, hi)), ((hi, hi), (lo, lo)), ((hi, lo), (lo, hi)), ((lo, hi), (hi, lo)))


def make_maze(size: int | str, seed: int) -> Maze:
    """The maze VisGym's maze_2d builds for this size and reset seed (see module docstring)."""
    side = resolve_size(size)
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    open_NN = wilson_carve(side - 2, random.Random(int(rng.integers(2**32))))
    walls_HW = np.ones((side, side), dtype=bool)
    walls_HW[1:-1, 1:-1] = ~open_NN
    start, goal = corner_pairs(side)[int(rng.integers(0, 4))]
    return Maze(walls_HW=walls_HW, start=start, goal=goal, seed=int(seed))


def step_pos(maze: Maze, pos: tuple[int, int], direction: int) -> tuple[int, int]:
    """Position after a move in direction 0..3; unchanged when the move hits a wall."""
    dr, dc = DELTAS[direction]
    r, c = pos[0] + dr, pos[1] + dc
    inside = 0 <= r < maze.size and 0 <= c < maze.size
    return (r, c) if inside and not maze.walls_HW[r, c] else pos


def shortest_path(maze: Maze, src: tuple[int, int], dst: tuple[int, int]) -> list[int]:
    """Directions (0..3) of a shortest path from src to dst by BFS; [] if src == dst.

    Raises ValueError when dst cannot be reached.
    """
    came_from: dict[tuple[int, int], tuple[tuple[int, int], int]] = {}
    frontier = deque([src])
    seen = {src}
    while frontier and dst not in seen:
        cell = frontier.popleft()
        for direction in range(len(DIRECTIONS)):
            nxt = step_pos(maze, cell, direction)
            if nxt not in seen:
                seen.add(nxt)
                came_from[nxt] = (cell, direction)
                frontier.append(nxt)
    if dst not in seen:
        raise ValueError(f"{dst} is not reachable from {src}")
    path: list[int] = []
    cell = dst
    while cell != src:
        cell, direction = came_from[cell]
        path.append(direction)
    return path[::-1]


def oracle_actions(maze: Maze, pos: tuple[int, int] | None = None) -> list[Action]:
    """Moves of a BFS shortest path from pos (default: start) to the goal; no stop appended."""
    src = maze.start if pos is None else (int(pos[0]), int(pos[1]))
    return [move(d) for d in shortest_path(maze, src, maze.goal)]


def render_image(maze: Maze, pos: tuple[int, int], px_per_cell: int = 25) -> np.ndarray:
    """RGB uint8 (size*px, size*px, 3): white floor, gray walls, red goal cell, blue agent disc.

    The disc has radius px/4 around the cell centre (VisGym draws it with pygame; here a pixel
    is blue when its centre lies within the radius).
    """
    colour_HW3 = np.where(maze.walls_HW[..., None], WALL_RGB, FLOOR_RGB).astype(np.uint8)
    colour_HW3[maze.goal] = GOAL_RGB
    image_HW3 = np.repeat(np.repeat(colour_HW3, px_per_cell, axis=0), px_per_cell, axis=1)
    centre = (np.arange(px_per_cell) + 0.5) - px_per_cell / 2
    disc_PP = centre[:, None] ** 2 + centre[None, :] ** 2 <= (px_per_cell / 4) ** 2
    r0, c0 = pos[0] * px_per_cell, pos[1] * px_per_cell
    image_HW3[r0 : r0 + px_per_cell, c0 : c0 + px_per_cell][disc_PP] = AGENT_RGB
    return image_HW3


def render_ascii(maze: Maze, pos: tuple[int, int]) -> str:
    """One line per row: '#' wall, '.' floor, 'G' goal, 'A' agent (drawn over the goal)."""
    chars_HW = np.where(maze.walls_HW, "#", ".")
    chars_HW[maze.goal] = "G"
    chars_HW[pos[0], pos[1]] = "A"
    return "\n".join("".join(row) for row in chars_HW)
