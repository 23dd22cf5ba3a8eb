"""Maze env: VisGym-identical mazes, rendering, oracle, turns, rewards, replay, ceilings."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter, deque
from pathlib import Path

import numpy as np
import pytest

from workbench.envs import (
    EVAL_SEEDS,
    SIZES,
    Action,
    InitState,
    Maze,
    MazeConfig,
    MazeEnv,
    budget_text,
    episode_reward,
    eval_set,
    format_action,
    make_maze,
    oracle_actions,
    oracle_ceiling,
    render_ascii,
    render_image,
    shortest_path_lengths,
    system_prompt,
)
from workbench.envs.env import FIRST_TRAIN_SEED
from workbench.envs.evalsets import (
    RESEED_STRIDE,
    distinct_tasks,
    eval_task_keys,
    init_maze,
    task_key,
    train_maze,
    train_states,
)
from workbench.envs.maze import DELTAS

# Printed by VisGym's own Maze2DEnv generation code (maze_2d.py at commit 0289034) for these
# reset seeds: our generator must give the same walls, start and goal.
VISGYM_MAZES = {
    (9, 0): ((7, 1), (1, 7), """\
#########
#.#.#.#.#
#.#.#.#.#
#.......#
###.#####
#.......#
###.###.#
#...#...#
#########"""),
    (11, 1): ((9, 1), (1, 9), """\
###########
#.#.......#
#.###.###.#
#.....#...#
#####.###.#
#.#...#...#
#.#.#####.#
#.#...#.#.#
#.###.#.#.#
#.......#.#
###########"""),
    (7, 5): ((1, 5), (5, 1), """\
#######
#...#.#
###.#.#
#.....#
###.###
#.....#
#######"""),
}
VISGYM_EASY_CORNERS = [((7, 1), (1, 7)), ((7, 1), (1, 7)), ((7, 7), (1, 1)), ((1, 1), (7, 7)),
                       ((1, 7), (7, 1)), ((1, 7), (7, 1)), ((7, 1), (1, 7)), ((7, 1), (1, 7))]


def walls_text(maze: Maze) -> str:
    return "\n".join("".join("#" if wall else "." for wall in row) for row in maze.walls_HW)


def distances_from(maze: Maze, src: tuple[int, int]) -> dict[tuple[int, int], int]:
    """Independent BFS distance map over open cells."""
    dist = {src: 0}
    frontier = deque([src])
    while frontier:
        r, c = frontier.popleft()
        for dr, dc in DELTAS:
            nxt = (r + dr, c + dc)
            if not maze.walls_HW[nxt] and nxt not in dist:
                dist[nxt] = dist[(r, c)] + 1
                frontier.append(nxt)
    return dist


# ---- maze generation ---------------------------------------------------------------------

@pytest.mark.parametrize(("key", "expected"), list(VISGYM_MAZES.items()))
def test_same_maze_as_visgym(key: tuple[int, int], expected: tuple) -> None:
    start, goal, text = expected
    maze = make_maze(*key)
    assert (maze.start, maze.goal, walls_text(maze)) == (start, goal, text)


def test_same_corners_as_visgym() -> None:
    assert [(make_maze(9, s).start, make_maze(9, s).goal) for s in range(8)] == VISGYM_EASY_CORNERS


def test_easy_path_lengths_match_visgym_figure() -> None:
    # VisGym: on easy seeds 0-63 shortest paths are 12 moves (50 mazes) or 16 moves (14 mazes)
    assert Counter(shortest_path_lengths(eval_set(9))) == {12: 50, 16: 14}


@pytest.mark.parametrize("size", sorted(SIZES.values()))
def test_mazes_are_perfect(size: int) -> None:
    for seed in range(16):
        maze = make_maze(size, seed)
        walls_HW = maze.walls_HW
        assert walls_HW.shape == (size, size) and walls_HW.dtype == bool
        assert walls_HW[0].all() and walls_HW[-1].all()
        assert walls_HW[:, 0].all() and walls_HW[:, -1].all()
        open_cells = {(int(r), int(c)) for r, c in np.argwhere(~walls_HW)}
        edges = sum((r, c + 1) in open_cells for r, c in open_cells) + sum(
            (r + 1, c) in open_cells for r, c in open_cells)
        assert edges == len(open_cells) - 1  # a tree: connected below, so no cycles
        assert set(distances_from(maze, maze.start)) == open_cells


@pytest.mark.parametrize("size", sorted(SIZES.values()))
def test_start_and_goal_are_opposite_corners(size: int) -> None:
    lo, hi = 1, size - 2
    for seed in range(16):
        maze = make_maze(size, seed)
        assert maze.start in {(lo, lo), (lo, hi), (hi, lo), (hi, hi)}
        assert maze.goal == (lo + hi - maze.start[0], lo + hi - maze.start[1])
        assert not maze.walls_HW[maze.start] and not maze.walls_HW[maze.goal]


def test_deterministic_per_seed_and_names() -> None:
    assert make_maze(9, 3) == make_maze(9, 3) == make_maze("easy", 3)
    assert make_maze("hard", 3).size == 11 and make_maze("tiny", 3).size == 5
    assert len({walls_text(make_maze(9, s)) for s in range(20)}) > 10
    with pytest.raises(ValueError):
        make_maze(9, 3).walls_HW[0, 0] = False


@pytest.mark.parametrize(("size", "seed"), [(8, 0), (3, 0), ("huge", 0), (9, -1)])
def test_bad_size_or_seed_raises(size: int | str, seed: int) -> None:
    with pytest.raises(ValueError):
        make_maze(size, seed)


# ---- rendering ---------------------------------------------------------------------------

@pytest.mark.parametrize(("size", "px", "side"), [(9, 25, 225), (11, 25, 275), (7, 32, 224)])
def test_image_size(size: int, px: int, side: int) -> None:
    maze = make_maze(size, 0)
    image_HW3 = render_image(maze, maze.start, px)
    assert image_HW3.shape == (side, side, 3) and image_HW3.dtype == np.uint8


@pytest.mark.parametrize("px", [25, 32])
def test_pixel_colours(px: int) -> None:
    maze = make_maze(9, 0)
    image_HW3 = render_image(maze, maze.start, px)

    def centre(cell: tuple[int, int]) -> tuple[int, ...]:
        return tuple(int(v) for v in image_HW3[cell[0] * px + px // 2, cell[1] * px + px // 2])

    floor = next((int(r), int(c)) for r, c in np.argwhere(~maze.walls_HW)
                 if (r, c) not in (maze.start, maze.goal))
    assert centre((0, 0)) == (169, 169, 169)
    assert centre(floor) == (255, 255, 255)
    assert centre(maze.goal) == (255, 0, 0)
    assert centre(maze.start) == (0, 0, 255)
    corner = image_HW3[maze.start[0] * px + 1, maze.start[1] * px + 1]
    assert tuple(int(v) for v in corner) == (255, 255, 255)  # the disc has radius px/4
    blue = (image_HW3 == (0, 0, 255)).all(axis=-1).sum()
    assert abs(blue - np.pi * (px / 4) ** 2) < 0.15 * np.pi * (px / 4) ** 2


def test_agent_drawn_over_goal() -> None:
    maze = make_maze(7, 0)
    image_HW3 = render_image(maze, maze.goal, 32)
    r, c = maze.goal[0] * 32, maze.goal[1] * 32
    assert tuple(image_HW3[r + 16, c + 16]) == (0, 0, 255)
    assert tuple(image_HW3[r + 1, c + 1]) == (255, 0, 0)
    assert render_ascii(maze, maze.goal).count("A") == 1
    assert "G" not in render_ascii(maze, maze.goal)


def test_ascii() -> None:
    maze = make_maze(9, 0)
    lines = render_ascii(maze, maze.start).split("\n")
    assert lines[7][1] == "A" and lines[1][7] == "G"
    assert len(lines) == 9 and all(len(line) == 9 for line in lines)
    assert walls_text(maze) == render_ascii(maze, maze.start).replace("A", ".").replace("G", ".")


# ---- oracle ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", sorted(SIZES.values()))
def test_oracle_is_a_shortest_path(size: int) -> None:
    for seed in range(16):
        maze = make_maze(size, seed)
        to_goal = distances_from(maze, maze.goal)
        pos = maze.start
        actions = oracle_actions(maze)
        assert len(actions) == to_goal[maze.start]
        for action in actions:
            assert action.kind == "move"
            dr, dc = DELTAS[action.direction]
            nxt = (pos[0] + dr, pos[1] + dc)
            assert to_goal[nxt] == to_goal[pos] - 1
            pos = nxt
        assert pos == maze.goal


def test_oracle_from_any_position() -> None:
    maze = make_maze(9, 4)
    to_goal = distances_from(maze, maze.goal)
    for cell, dist in to_goal.items():
        assert len(oracle_actions(maze, cell)) == dist
    assert oracle_actions(maze, maze.goal) == []


# ---- the env -----------------------------------------------------------------------------

def wall_direction(maze: Maze, pos: tuple[int, int]) -> int:
    return next(d for d, (dr, dc) in enumerate(DELTAS) if maze.walls_HW[pos[0] + dr, pos[1] + dc])


def test_reset_observation_and_info() -> None:
    env = MazeEnv(MazeConfig(size=7, px_per_cell=32))
    obs, info = env.reset(seed=5)
    assert env.observation_space.contains(obs)
    assert obs["image"].shape == (224, 224, 3) and obs["pos"] == (1, 5)
    assert obs["text"] == render_ascii(make_maze(7, 5), (1, 5))
    assert info["turn"] == 0 and info["budget_text"] == budget_text(0, 15)
    assert env.maze == make_maze(7, 5) and env.turn == 0 and not env.done


def test_reset_without_seed_draws_a_held_out_training_maze() -> None:
    env = MazeEnv()
    seeds = set()
    for k in range(30):
        env.reset(seed=k)  # seeds the env's generator; then draws without a seed
        env.reset()
        seeds.add(env.maze.seed)
        assert env.maze.seed >= FIRST_TRAIN_SEED
        assert task_key(env.maze) not in eval_task_keys(7)
    assert len(seeds) == 30


def test_budget_text_is_visgyms() -> None:
    assert budget_text(0, 15) == "This is step 1. You are allowed to take 14 more steps."
    assert budget_text(14, 15) == "This is step 15. You are allowed to take 0 more steps."
    env = MazeEnv(MazeConfig(max_turns=15))
    env.reset(seed=0)
    assert env.step("up")[4]["budget_text"] == budget_text(1, 15)


def test_invalid_action_costs_a_turn_and_stays() -> None:
    env = MazeEnv(MazeConfig(size=7))
    obs0, _ = env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step("fly away")
    assert obs["pos"] == obs0["pos"] and np.array_equal(obs["image"], obs0["image"])
    assert (reward, terminated, truncated, info["turn"]) == (0.0, False, False, 1)
    assert info["action"].kind == "invalid" and info["feedback"] == info["action"].error != ""


def test_wall_bump() -> None:
    env = MazeEnv(MazeConfig(size=9))
    env.reset(seed=0)
    d = wall_direction(env.maze, env.pos)
    start = env.pos
    obs, _, _, _, info = env.step(Action("move", d, ""))
    assert obs["pos"] == start and info["feedback"] == "Cannot move into a wall."
    assert info["turn"] == 1 and info["action"].valid


def test_moves_follow_visgym_directions() -> None:
    env = MazeEnv(MazeConfig(size=9, grammar="tuple"))
    env.reset(seed=0)  # start (7, 1): right is open
    obs, _, _, _, info = env.step("('move', 0)")
    assert obs["pos"] == (7, 2) and info["feedback"] == "Action executed successfully."


def play(env: MazeEnv, replies: list[str]) -> list[tuple]:
    return [env.step(reply) for reply in replies]


def test_reach_goal_terminates_on_goal() -> None:
    env = MazeEnv(MazeConfig(size=7, reward="reach_goal"))
    env.reset(seed=2)
    steps = play(env, [format_action(a, "keyword") for a in oracle_actions(env.maze)])
    assert all(not s[2] and not s[3] and s[1] == 0.0 for s in steps[:-1])
    _, reward, terminated, truncated, info = steps[-1]
    assert (reward, terminated, truncated, info["success"]) == (1.0, True, False, True)
    assert env.done and env.pos == env.maze.goal
    with pytest.raises(RuntimeError):
        env.step("up")


def test_stop_on_goal_needs_a_stop() -> None:
    env = MazeEnv(MazeConfig(size=7, reward="stop_on_goal", grammar="tuple"))
    env.reset(seed=2)
    steps = play(env, [format_action(a, "tuple") for a in oracle_actions(env.maze)])
    assert env.pos == env.maze.goal and not any(s[2] or s[3] for s in steps)
    assert not steps[-1][4]["success"]
    _, reward, terminated, _, info = env.step("('stop', 'stop')")
    assert (reward, terminated, info["success"]) == (1.0, True, True)


def test_stop_off_goal_fails() -> None:
    env = MazeEnv(MazeConfig(size=7, reward="stop_on_goal"))
    env.reset(seed=2)
    _, reward, terminated, truncated, info = env.step("stop")
    assert (reward, terminated, truncated, info["success"]) == (0.0, True, False, False)


def test_truncated_at_max_turns() -> None:
    env = MazeEnv(MazeConfig(size=7, max_turns=3))
    env.reset(seed=0)
    steps = play(env, ["nonsense"] * 3)
    assert [s[3] for s in steps] == [False, False, True]
    assert not any(s[2] for s in steps) and steps[-1][4]["turn"] == 3 and env.done


def test_format_term() -> None:
    assert episode_reward(1.0, 4, 5, 0.2) == pytest.approx(0.8 + 0.2 * 0.8)
    assert episode_reward(0.0, 3, 3, 0.2) == pytest.approx(0.2)
    assert episode_reward(1.0, 0, 0, 0.0) == 1.0
    env = MazeEnv(MazeConfig(size=7, format_weight=0.2))
    env.reset(seed=2)
    replies = ["nope"] + [format_action(a, "keyword") for a in oracle_actions(env.maze)]
    *_, (_, reward, terminated, _, info) = play(env, replies)
    n = len(replies)
    assert terminated and info["task_reward"] == 1.0 and info["n_valid"] == n - 1
    assert info["format_reward"] == pytest.approx((n - 1) / n)
    assert reward == info["episode_reward"] == pytest.approx(0.8 + 0.2 * (n - 1) / n)


def test_init_state_replays_exactly() -> None:
    config = MazeConfig(size=9, px_per_cell=25)
    env = MazeEnv(config)
    env.reset(seed=7)
    replies = ["up", "left", "junk", "down", "right", "right", "up"]
    first = [env.reset(seed=7)[0]["image"]] + [s[0]["image"] for s in play(env, replies)]
    state = InitState.from_dict(json.loads(json.dumps(env.init_state().to_dict())))
    assert state == env.init_state()
    other = MazeEnv(config)
    other.reset(seed=123)
    again = [other.reset(options={"init_state": state})[0]["image"]]
    again += [s[0]["image"] for s in play(other, replies)]
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_init_state_restores_start_and_goal() -> None:
    maze = make_maze(9, 7)
    state = InitState(maze_seed=7, size=9, start=maze.goal, goal=maze.start)
    env = MazeEnv(MazeConfig(size=9))
    obs, _ = env.reset(options={"init_state": state.to_dict()})
    assert obs["pos"] == maze.goal and env.maze.goal == maze.start
    assert env.init_state() == state
    with pytest.raises(ValueError, match="size"):
        MazeEnv(MazeConfig(size=7)).reset(options={"init_state": state})


@pytest.mark.parametrize(("field", "value"), [
    ("grammar", "json"), ("reward", "dense"), ("observation", "video"), ("size", 8),
    ("max_turns", 0), ("format_weight", 1.5), ("px_per_cell", 2),
])
def test_config_validation_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        MazeConfig(**{field: value})


def test_config_accepts_size_names_and_error_lists_choices() -> None:
    assert MazeConfig(size="easy").size == 9
    with pytest.raises(ValueError, match="keyword"):
        MazeConfig(grammar="json")


def test_system_prompt_mentions_actions() -> None:
    text = system_prompt(MazeConfig(max_turns=15))
    assert all(word in text for word in ("up", "down", "left", "right", "stop", "15"))
    assert "('move', 0)" in system_prompt(MazeConfig(grammar="tuple"))
    assert "'#'" in system_prompt(MazeConfig(observation="ascii"))


# ---- eval sets ---------------------------------------------------------------------------

@pytest.mark.parametrize("size", [7, 9, 11, 13])
def test_training_mazes_never_hold_an_eval_task(size: int) -> None:
    held = eval_task_keys(size)
    assert held == {task_key(make_maze(size, seed)) for seed in EVAL_SEEDS}
    mazes = [train_maze(size, i) for i in range(2_000)]
    assert not {task_key(m) for m in mazes} & held
    assert all(m.seed >= FIRST_TRAIN_SEED for m in mazes)
    assert train_maze(size, 17) == mazes[17]  # a function of the index


def test_the_7x7_eval_tasks_are_reseeded_by_construction() -> None:
    # Plain seeds from FIRST_TRAIN_SEED hit the 60 eval tasks about once in 13 (768 tasks in
    # all); each such index takes seed + k * RESEED_STRIDE instead.
    plain = [make_maze(7, FIRST_TRAIN_SEED + i) for i in range(2_000)]
    hits = [i for i, m in enumerate(plain) if task_key(m) in eval_task_keys(7)]
    assert 100 < len(hits) < 220
    for i in hits[:20]:
        maze = train_maze(7, i)
        assert (maze.seed - FIRST_TRAIN_SEED - i) % RESEED_STRIDE == 0
        assert maze.seed != plain[i].seed


def test_distinct_task_counts() -> None:
    # Kirchhoff: spanning trees of the 2x2, 3x3, 4x4 and 5x5 cell grids (OEIS A007341) x 4 goals.
    assert [distinct_tasks(s) for s in (5, 7, 9, 11)] == [16, 768, 401_408, 2_230_272_000]
    assert [len(eval_task_keys(s)) for s in (5, 7, 9, 11)] == [16, 60, 64, 64]
    counted = {task_key(make_maze(7, seed)) for seed in range(20_000)}
    assert len(counted) == distinct_tasks(7)


def test_5x5_has_nothing_left_to_train_on() -> None:
    with pytest.raises(ValueError, match="16 distinct tasks and the 64-maze eval set holds all"):
        train_maze(5, 0)
    with pytest.raises(ValueError, match="size 7 or larger"):
        MazeEnv(MazeConfig(size=5)).reset()


def test_the_demo_and_the_pretrained_policy_never_train_on_an_eval_task() -> None:
    from workbench.demo import demo_config
    from workbench.rl.pretrained import RECIPE
    from workbench.rl.schedule import step_mazes
    from workbench.rl.sft import SFT_INDEX_OFFSET

    held = eval_task_keys(9)
    steps, batch = (int(RECIPE.setting(k)) for k in ("sft.steps", "sft.batch_size"))
    sft = train_states(9, SFT_INDEX_OFFSET + int(RECIPE.setting("trainer.seed")) * 100_000_000,
                       steps * batch)
    for long in (False, True):
        config = demo_config(Path("unused"), long)
        assert config.env.size == int(RECIPE.setting("env.size")) == 9
        grpo = [s for step in range(1, config.trainer.total_steps + 1)
                for s in step_mazes(config, step)]
        assert not {task_key(init_maze(s)) for s in sft + grpo} & held


def test_eval_set_is_the_seeded_mazes() -> None:
    states = eval_set(9)
    assert len(states) == 64 and [s.maze_seed for s in states] == list(EVAL_SEEDS)
    assert states[0] == InitState(maze_seed=0, size=9, start=(7, 1), goal=(1, 7))
    assert len(eval_set("small", n=8)) == 8
    with pytest.raises(ValueError):
        eval_set(9, n=65)


# Ceilings at max_turns 15 on seeds 0-63: (reach_goal, stop_on_goal). Our generator matches
# VisGym's, so easy/stop_on_goal = 50 is VisGym's figure. Hard needs >= 16 moves: 0 at 15 turns.
CEILINGS_15 = {5: (64, 64), 7: (63, 63), 9: (50, 50), 11: (0, 0)}


@pytest.mark.parametrize(("size", "expected"), list(CEILINGS_15.items()))
def test_oracle_ceilings(size: int, expected: tuple[int, int]) -> None:
    states = eval_set(size)
    got = (oracle_ceiling(states, 15, "reach_goal"), oracle_ceiling(states, 15, "stop_on_goal"))
    assert got == expected


def test_ceiling_rule_boundary() -> None:
    states = eval_set(9)  # paths of 12 and 16 moves
    assert oracle_ceiling(states, 12, "reach_goal") == 50
    assert oracle_ceiling(states, 12, "stop_on_goal") == 0
    assert oracle_ceiling(states, 16, "stop_on_goal") == 50
    assert oracle_ceiling(states, 16, "reach_goal") == 64
    with pytest.raises(ValueError):
        oracle_ceiling(states, 15, "dense")


def test_oracle_reaches_ceiling_in_the_env() -> None:
    config = MazeConfig(size=9, reward="stop_on_goal", max_turns=15, grammar="tuple")
    env = MazeEnv(config)
    wins = 0
    for state in eval_set(9):
        env.reset(options={"init_state": state})
        replies = [format_action(a, "tuple") for a in oracle_actions(env.maze)]
        for reply in [*replies, "('stop', 'stop')"]:
            _, _, terminated, truncated, info = env.step(reply)
            if terminated or truncated:
                break
        wins += info["success"]
    assert wins == 50


def test_env_runs_without_gymnasium() -> None:
    # The GPU image has no gymnasium: the env must still import, reset and step there.
    code = (
        "import sys; sys.modules['gymnasium'] = None\n"
        "from workbench.envs import MazeConfig, MazeEnv, make_maze\n"
        "env = MazeEnv(MazeConfig(size=9))\n"
        "obs, _ = env.reset(seed=0)\n"
        "assert obs['pos'] == (7, 1) and env.maze == make_maze(9, 0)\n"
        "assert env.step('right')[0]['pos'] == (7, 2)\n"
        "env.reset()\n"
        "assert env.maze.seed >= 1_000_000 and not hasattr(env, 'observation_space')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert done.returncode == 0, done.stderr
