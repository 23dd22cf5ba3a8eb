"""benchmarks/trl_compare.py's task, without TRL: the single-turn reward and the prompt set."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import trl_compare
from workbench.envs import DIRECTIONS, MazeConfig, make_maze, oracle_actions
from workbench.envs.maze import step_pos

CONFIG = MazeConfig(size=7)


@pytest.fixture(scope="module")
def bench():
    """The benchmark module (it imports TRL only inside the functions that run it)."""
    return trl_compare


def test_reward_is_one_exactly_for_the_oracle_move(bench) -> None:
    for p in bench.sample_prompts(CONFIG, 16, seed=3):
        maze = make_maze(CONFIG.size, p.maze_seed)
        best = oracle_actions(maze, p.pos)[0].direction
        for d, word in enumerate(DIRECTIONS):
            hits_wall = step_pos(maze, p.pos, d) == p.pos
            reward = bench.move_reward(word, p.maze_seed, p.pos, CONFIG)
            assert reward == (1.0 if d == best else 0.0), (p, word, hits_wall)
            assert reward == 0.0 or not hits_wall
        assert bench.move_reward(f"  {DIRECTIONS[best].upper()}. ", p.maze_seed, p.pos,
                                 CONFIG) == 1.0
        for junk in ("stop", "", "up down", "fly"):
            assert bench.move_reward(junk, p.maze_seed, p.pos, CONFIG) == 0.0


def test_prompts_are_seeded_open_squares_off_the_goal(bench) -> None:
    a, b = bench.sample_prompts(CONFIG, 8, seed=0), bench.sample_prompts(CONFIG, 8, seed=0)
    assert [(p.maze_seed, p.pos, p.text) for p in a] == [(p.maze_seed, p.pos, p.text) for p in b]
    assert all(np.array_equal(x.image_HW3, y.image_HW3) for x, y in zip(a, b))
    for p in a:
        maze = make_maze(CONFIG.size, p.maze_seed)
        assert not maze.walls_HW[p.pos] and p.pos != maze.goal
        assert p.image_HW3.shape == (7 * CONFIG.px_per_cell, 7 * CONFIG.px_per_cell, 3)
        assert p.text.startswith("This is step 1.")
    assert len({p.maze_seed for p in a}) == 8
