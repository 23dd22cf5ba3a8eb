"""Fixed evaluation mazes, training mazes held out from them by construction, and the oracle's
success ceiling.

The eval set is maze seeds 0-63 (SkyRL's VisGym recipe: 64 seeded rows). A maze's *task* is its
walls and its goal (the start is the opposite corner, so this is VisGym's (walls, start, goal);
keying on the goal alone also covers episodes started elsewhere). Disjoint seeds are not enough:
a 7x7 maze has only 768 distinct tasks, and the first 20,000 seeds hold all of them. So every
training maze comes from `train_maze(size, index)`, which skips any maze whose task is one of the
64 eval mazes' at that size; SFT, GRPO and `MazeEnv.reset()` without a seed all draw from it.
`oracle_ceiling` says how many eval mazes a perfect agent can solve within max_turns: on easy
(9x9) at 15 turns with VisGym's stop rule it is 50 of 64, because 14 mazes need 16 moves.

    states = eval_set(7)                      # 64 InitStates, 60 distinct tasks
    maze = train_maze(7, 0)                   # never one of those 60 tasks
    distinct_tasks(7)                         # 768 = 192 perfect mazes x 4 corner goals
"""

from __future__ import annotations

from fractions import Fraction
from functools import cache

from workbench.envs.maze import Maze, make_maze, resolve_size, shortest_path
from workbench.envs.rewards import EXTRA_TURNS
from workbench.envs.state import FIRST_TRAIN_SEED, InitState, init_maze, init_state_of

EVAL_SEEDS: range = range(64)
"""Maze seeds of the 64-maze evaluation set."""

RESEED_STRIDE = 1_000_003
"""A training index whose own seed is an eval task tries seed + k * RESEED_STRIDE, k = 1, 2, ..."""


def task_key(maze: Maze) -> tuple[int, bytes, tuple[int, int]]:
    """What makes two mazes the same task for held-out purposes: size, walls and goal."""
    return (maze.size, maze.walls_HW.tobytes(), maze.goal)


@cache
def eval_task_keys(size: int | str) -> frozenset[tuple[int, bytes, tuple[int, int]]]:
    """The task keys of all 64 eval mazes at this size (held out whatever eval.n_mazes is)."""
    side = resolve_size(size)
    return frozenset(task_key(make_maze(side, seed)) for seed in EVAL_SEEDS)


def spanning_trees(rows: int, cols: int) -> int:
    """Spanning trees of a rows x cols grid graph (Kirchhoff's theorem, exact integer Bareiss
    determinant): the number of perfect mazes Wilson's algorithm can carve on that many cells."""
    n = rows * cols
    laplacian = [[Fraction(0)] * n for _ in range(n)]
    for r in range(rows):
        for c in range(cols):
            for dr, dc in ((0, 1), (1, 0)):
                if r + dr < rows and c + dc < cols:
                    i, j = r * cols + c, (r + dr) * cols + c + dc
                    laplacian[i][i] += 1
                    laplacian[j][j] += 1
                    laplacian[i][j] -= 1
                    laplacian[j][i] -= 1
    return _determinant([row[1:] for row in laplacian[1:]])


def _determinant(matrix: list[list[Fraction]]) -> int:
    """Exact determinant by Gaussian elimination over fractions (the matrices here are small)."""
    m, det = [row[:] for row in matrix], Fraction(1)
    for k in range(len(m)):
        pivot = next((i for i in range(k, len(m)) if m[i][k] != 0), None)
        if pivot is None:
            return 0
        if pivot != k:
            m[k], m[pivot], det = m[pivot], m[k], -det
        det *= m[k][k]
        for i in range(k + 1, len(m)):
            factor = m[i][k] / m[k][k]
            m[i] = [a - factor * b for a, b in zip(m[i], m[k])]
    return int(det)


@cache
def distinct_tasks(size: int | str) -> int:
    """Distinct tasks at this size: perfect mazes on its (size-1)/2 squared cells, times the
    four corner goals (5: 16, 7: 768, 9: 401,408, 11: 2,230,272,000)."""
    cells = (resolve_size(size) - 1) // 2
    return 4 * spanning_trees(cells, cells)


def check_trainable(size: int | str) -> int:
    """The size as an int, or ValueError when the eval set holds every task of that size."""
    side = resolve_size(size)
    held = len(eval_task_keys(side))
    if held >= distinct_tasks(side):
        raise ValueError(
            f"{side}x{side} mazes have {distinct_tasks(side)} distinct tasks and the 64-maze eval "
            f"set holds all of them, so no training maze could be held out from the evaluation; "
            f"train on size 7 or larger (env.size)")
    return side


def train_maze(size: int | str, index: int) -> Maze:
    """The index-th training maze (index >= 0): seed FIRST_TRAIN_SEED + index, unless that maze is
    an eval task; then the first of seed + k * RESEED_STRIDE (k = 1, 2, ...) that is not."""
    side = check_trainable(size)
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    held, seed = eval_task_keys(side), FIRST_TRAIN_SEED + index
    maze = make_maze(side, seed)
    while task_key(maze) in held:
        seed += RESEED_STRIDE
        maze = make_maze(side, seed)
    return maze


def train_states(size: int | str, start: int, n: int) -> list[InitState]:
    """InitStates of training mazes start, start + 1, ..., start + n - 1 (all held out)."""
    return [init_state_of(train_maze(size, start + i)) for i in range(n)]


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
