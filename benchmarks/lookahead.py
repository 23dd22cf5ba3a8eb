"""How far a maze agent must look: a scripted agent that never revisits a square and, before each
move, looks k squares down every open branch (dropping the branches that die sooner and hold no
goal), moving toward the goal among the rest. Solved mazes of the 64 held-out ones per k.

    python benchmarks/lookahead.py            # 9x9 (VisGym easy), 15 turns
    python benchmarks/lookahead.py --size 7

Answers: How far ahead must a maze agent look to solve the held-out mazes in the turn budget?
Figures: benchmarks/RESULTS.md, "What limits the tiny policy".
"""

from __future__ import annotations

import argparse

from workbench.envs import Maze, eval_set, init_maze
from workbench.envs.maze import step_pos


def branches(maze: Maze, pos: tuple[int, int]) -> list[tuple[int, int]]:
    """The squares one move from pos (walls excluded)."""
    return [n for n in (step_pos(maze, pos, d) for d in range(4)) if n != pos]


def alive(maze: Maze, came_from: tuple[int, int], pos: tuple[int, int], k: int) -> bool:
    """Whether the branch entered at pos reaches the goal or runs on for k more squares."""
    if pos == maze.goal or k == 0:
        return True
    return any(alive(maze, pos, n, k - 1) for n in branches(maze, pos) if n != came_from)


def solves(maze: Maze, k: int, max_turns: int) -> bool:
    """Play the look-ahead-k agent for max_turns moves; whether it reaches the goal."""
    pos, visited, path = maze.start, {maze.start}, [maze.start]
    for _ in range(max_turns):
        if pos == maze.goal:
            return True
        fresh = [n for n in branches(maze, pos) if n not in visited]
        picks = [n for n in fresh if alive(maze, pos, n, k)] or fresh
        if picks:
            pos = min(picks, key=lambda n: abs(n[0] - maze.goal[0]) + abs(n[1] - maze.goal[1]))
            path.append(pos)
        else:  # a dead end: step back
            path.pop()
            pos = path[-1]
        visited.add(pos)
    return pos == maze.goal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=9)
    p.add_argument("--max-turns", type=int, default=15)
    args = p.parse_args()
    mazes = [init_maze(s) for s in eval_set(args.size)]
    for k in (0, 2, 4, 6, 8, 12, 20):
        print(f"look-ahead {k:>2} squares: {sum(solves(m, k, args.max_turns) for m in mazes)}/64")


if __name__ == "__main__":
    main()
