"""A second task through the same seam: the open room (envs/room.py) plays through the session,
the episode loop and the phases with no code of its own outside envs/."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from workbench.envs.protocol import Task, TaskEnv
from workbench.envs.room import RoomConfig, RoomState, room_states
from workbench.envs.tasks import TASKS
from workbench.model import LoraSettings
from workbench.policy import SamplingParams
from workbench.rl import phases
from workbench.session import AdamParams, LossConfig, SessionSpec, create_session


def test_registry_names_both_tasks_and_their_states() -> None:
    assert sorted(TASKS) == ["maze", "room"]
    room = TASKS["room"]
    assert room.config is RoomConfig
    assert room.train_states(5, 0, 3) == room_states(5, 0, 3)
    assert room.eval_states(5, 4) != room.train_states(5, 0, 4)
    assert isinstance(TASKS["maze"].eval_states(7, 2)[0].maze_seed, int)


def test_room_follows_the_protocol_and_its_rules() -> None:
    task: Task = RoomConfig(size=5, max_turns=4)
    env: TaskEnv = task.make_env()
    obs, info = env.reset(options={"init_state": RoomState(5, start=(1, 1), goal=(1, 3))})
    assert obs["image"].shape == (80, 80, 3) and obs["image"].dtype == np.uint8
    assert info["budget_text"].startswith("This is step 1.") and env.pos == (1, 1)
    _, reward, terminated, _, info = env.step("up")  # into the edge wall
    assert (env.pos, reward, terminated, info["feedback"]) == (
        (1, 1), 0.0, False, "Cannot move into a wall.")
    _, _, _, _, info = env.step("jump")
    assert info["action"].kind == "invalid" and info["feedback"] == info["action"].error != ""
    env.step("right")
    _, reward, terminated, truncated, info = env.step("right")
    assert (env.pos, reward, terminated, truncated, info["success"], env.done) == (
        (1, 3), 1.0, True, False, True, True)
    assert "empty 5x5 room" in task.rules()


def test_room_is_truncated_at_its_turn_budget() -> None:
    env = RoomConfig(size=5, max_turns=2).make_env()
    env.reset(options={"init_state": RoomState(5, start=(1, 1), goal=(3, 3))})
    env.step("down")
    _, reward, terminated, truncated, _ = env.step("up")
    assert (reward, terminated, truncated, env.done) == (0.0, False, True, True)


def test_room_plays_through_the_session_and_the_phases(tiny_dir: Path, tmp_path: Path) -> None:
    """rollout -> score -> advantages -> datums -> update on the room, unchanged code."""
    spec = SessionSpec(str(tiny_dir), LoraSettings(rank=4, alpha=8), workdir=str(tmp_path))
    session = create_session(spec)
    try:
        tc = session.training_client
        sampler = tc.save_weights_and_get_sampling_client()
        task, states = RoomConfig(size=5, max_turns=3), room_states(5, 0, 3)
        ro = phases.rollout(sampler, task, states, 4, SamplingParams(max_tokens=2), seed=3)
        again = phases.rollout(sampler, task, states, 4, SamplingParams(max_tokens=2), seed=3)
        assert [[ep.replies for ep in g] for g in ro.episodes_P_G] == \
            [[ep.replies for ep in g] for g in again.episodes_P_G]  # seeded
        for state, group in zip(states, ro.episodes_P_G):
            for ep in group:
                assert ep.init_state == state and ep.positions[0] == state.start
                assert 1 <= ep.turns <= 3 and ep.stream is not None
                assert ep.success == (ep.positions[-1] == state.goal)
        rewards_P_G = np.array([[1.0, 0.0, 0.0, 0.0]] * 3)  # a signal for the update
        adv = phases.advantages(rewards_P_G)
        datums = phases.make_datums(ro, adv)
        assert len(datums) == 12
        up = phases.update(tc, datums, "ppo", LossConfig(reduction="sequence_mean"),
                           AdamParams(learning_rate=1e-3))
        assert up.datums == 12 and up.grad_norm > 0 and np.isfinite(up.metrics["loss"])
    finally:
        session.close()


@pytest.mark.parametrize("size", [5, 7])
def test_room_states_are_distinct_cells_inside_the_walls(size: int) -> None:
    for s in room_states(size, 0, 50):
        assert s.start != s.goal
        assert all(1 <= v <= size - 2 for v in (*s.start, *s.goal))
