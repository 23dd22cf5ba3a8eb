"""A second task through the same seam: the open room (envs/room.py) plays through the session,
the episode loop and the phases with no code of its own outside envs/, and trains from the
command line (`env.task=room`: SFT, GRPO, evaluation, ceilings and baselines through
envs.tasks.TASKS)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from workbench.cli import main
from workbench.config import PRESETS, ConfigError, apply_overrides
from workbench.envs import MazeConfig, eval_set, oracle_ceiling
from workbench.envs.protocol import Task, TaskEnv
from workbench.envs.room import RoomConfig, RoomEnv, RoomState, room_states
from workbench.envs.tasks import SCRIPTED, TASKS
from workbench.model import LoraSettings
from workbench.policy import SamplingParams
from workbench.rl import phases, play_scripted
from workbench.rl.schedule import eval_batch, step_batch
from workbench.run import read_metrics, source_hash
from workbench.session import AdamParams, LossConfig, SessionSpec, create_session


def test_registry_names_both_tasks_and_their_states() -> None:
    assert sorted(TASKS) == ["maze", "room"]
    room = TASKS["room"]
    assert room.make({"size": 5, "px_per_cell": 8, "grammar": "tuple", "reward": "reach_goal",
                      "format_weight": 0.0, "observation": "ascii", "max_turns": 3}) == \
        RoomConfig(size=5, px_per_cell=8, grammar="tuple", max_turns=3, observation="ascii")
    assert room.train_states(5, 0, 3) == room_states(5, 0, 3)
    assert [s.seed for s in room.train_states(5, 4, 2)] == [4, 5]
    assert room.eval_states(5, 4) != room.train_states(5, 0, 4)
    assert isinstance(TASKS["maze"].eval_states(7, 2)[0].maze_seed, int)


def test_env_task_picks_the_config_states_and_ceiling() -> None:
    maze = apply_overrides(PRESETS["tiny"], ["env.size=7", "generator.max_turns=6"])
    assert maze.task == MazeConfig(size=7, max_turns=6)
    assert eval_batch(maze).states_P == eval_set(7, 64)
    room = apply_overrides(maze, ["env.task=room", "eval.n_mazes=8"])
    assert room.task == RoomConfig(size=7, max_turns=6)
    batch = step_batch(room, 2)  # training states 8..15 of trainer.train_batch_size=8
    assert (batch.task, batch.states_P, batch.G) == (room.task, room_states(7, 8, 8), 8)
    assert eval_batch(room).states_P == TASKS["room"].eval_states(7, 8)
    assert MazeConfig(size=5, max_turns=4).ceiling(eval_set(5, 3)) == oracle_ceiling(
        eval_set(5, 3), 4, "reach_goal") == 3
    far = [RoomState(7, (1, 1), (5, 5)), RoomState(7, (1, 1), (1, 2))]  # 8 moves and 1
    assert (RoomConfig(size=7, max_turns=7).ceiling(far),
            RoomConfig(size=7, max_turns=8).ceiling(far)) == (1, 2)


def test_env_task_names_its_choices_and_what_the_room_refuses() -> None:
    with pytest.raises(ConfigError, match=r"^env.task='rooms' is not one of \['maze', 'room'\] "
                                          r"\(did you mean 'room'\?\)"):
        apply_overrides(PRESETS["tiny"], ["env.task=rooms"])
    with pytest.raises(ConfigError, match=r"^env: the room rewards reaching its goal only: it "
                                          r"takes reward=reach_goal and format_weight=0, not "
                                          r"'stop_on_goal' and 0.0"):
        apply_overrides(PRESETS["tiny"], ["env.task=room", "env.reward=stop_on_goal"])
    with pytest.raises(ConfigError, match=r"^env: a room needs size >= 4"):
        apply_overrides(PRESETS["tiny"], ["env.task=room", "env.size=3"])


def test_scripted_policies_play_the_room_and_its_step_record() -> None:
    task, states = RoomConfig(size=5, max_turns=8), room_states(5, 0, 6)
    oracle = play_scripted(SCRIPTED["oracle"], task, states)
    assert all(g[0].success for g in oracle) and task.ceiling(states) == 6
    assert [g[0].turns for g in oracle] == [len(g[0].positions) - 1 for g in oracle]
    env = task.make_env()
    env.reset(options={"init_state": states[0]})  # a step record's state (JSON) draws the same
    assert TASKS["room"].recorded_maze(json.loads(json.dumps(states[0].to_dict()))) == env.maze


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
        batch = phases.Batch(task, states, G=4, params=SamplingParams(max_tokens=2), seed=3)
        ro, again = phases.rollout(sampler, batch), phases.rollout(sampler, batch)
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
        up = phases.update(tc, datums, phases.UpdateSettings(
            "ppo", LossConfig(reduction="sequence_mean"), AdamParams(learning_rate=1e-3)))
        assert up.datums == 12 and up.grad_norm > 0 and np.isfinite(up.metrics["loss"])
    finally:
        session.close()


@pytest.mark.parametrize("size", [5, 7])
def test_room_states_are_distinct_cells_inside_the_walls(size: int) -> None:
    for s in room_states(size, 0, 50):
        assert s.start != s.goal
        assert all(1 <= v <= size - 2 for v in (*s.start, *s.goal))


ROOM_RUN = ["env.task=room", "env.size=5", "generator.max_turns=4", "lora.rank=4",
            "lora.alpha=8"]


def test_room_trains_and_evaluates_from_the_command_line(tiny_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """`python -m workbench sft env.task=room`, then `train env.task=room` from that model:
    oracle SFT on room states, GRPO steps with an update, evaluations against the room's
    ceiling, step records that replay exactly and the manifest's reward hash (about 23 s)."""
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    main(["sft", *ROOM_RUN, f"model.name={tiny_dir}", "sft.steps=30", "sft.batch_size=4",
          "sft.learning_rate=3e-3", f"run_dir={sft}"])
    main(["train", *ROOM_RUN, f"model.name={sft / 'model'}", "generator.max_tokens=2",
          "generator.n_samples_per_prompt=4", "trainer.train_batch_size=2",
          "trainer.total_steps=2", "algorithm.learning_rate=1e-3", "trainer.ckpt_interval=1",
          "eval.n_mazes=4", "eval.sampled_passes=1", f"run_dir={grpo}"])
    out = capsys.readouterr().out
    assert "SFT steps: 30/30" in out and "GRPO steps: 2/2" in out
    rows = read_metrics(grpo)
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/n_mazes" in r]
    ceiling = RoomConfig(size=5, max_turns=4).ceiling(TASKS["room"].eval_states(5, 4))
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    assert all(r["eval/ceiling"] == ceiling == 4 and r["eval/n_mazes"] == 4 for r in evals)
    updated = [r["step"] for r in steps if r["update/datums"] > 0]
    assert updated, "no step had a group with signal"
    main(["replay", str(grpo), "--step", str(updated[0])])  # datums redrawn from room states
    assert capsys.readouterr().out.rstrip().endswith("exact")
    record = json.loads((grpo / "steps" / "step_000001" / "episodes.json").read_text())
    first = record["episodes_P_G"][0][0]["init_state"]
    assert RoomState(**first | {"start": tuple(first["start"]), "goal": tuple(first["goal"])}) \
        == step_batch(apply_overrides(PRESETS["tiny"], ROOM_RUN + [
            "trainer.train_batch_size=2"]), 1).states_P[0]
    manifest = json.loads((grpo / "manifest.json").read_text())
    assert manifest["reward_source_sha256"] == source_hash(RoomEnv.step, phases.env_reward)
