"""Pictures, widgets and notebook helpers without a browser or a model: failure reasons of
scripted episodes, widget state after moving sliders (ipywidgets 8 runs without a front end),
the step inspector over a hand-made run folder, plots, recorded metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import numpy as np
import pytest

from workbench.config import RunConfig, to_dict
from workbench.envs import MazeConfig, eval_set, format_action, oracle_actions
from workbench.envs.actions import move
from workbench.envs.maze import step_pos
from workbench.notebook import comparable, jsonable, read_recorded, record_metrics
from workbench.rl import FAILURE_REASONS, SCRIPTED, failure_reason, play_scripted, wasted_turns
from workbench.rl.inspect import module_name, ratio_stats
from workbench.run import episode_summary
from workbench.session.losses import LossConfig
from workbench.viz import (
    frame_png,
    group_view,
    noise_band,
    plot_advantages,
    plot_grad_norms,
    plot_logprob_scatter,
    plot_phase_times,
    plot_training,
    step_inspector,
    trajectory_player,
    turn_rows,
)

matplotlib.use("Agg")
CONFIG = MazeConfig(size=5, max_turns=6)
STATES = eval_set(5, 4)


def _play(policy, config: MazeConfig = CONFIG, state_index: int = 0):
    return play_scripted(policy, config, [STATES[state_index]])[0][0]


def _blocked(maze, pos) -> int:
    return next(d for d in range(4) if step_pos(maze, pos, d) == pos)


def _open(maze, pos) -> int:
    return next(d for d in range(4) if step_pos(maze, pos, d) != pos)


def babble(maze, pos, config, rng) -> str:
    return "hello there"


def bump(maze, pos, config, rng) -> str:
    return format_action(move(_blocked(maze, pos)), config.grammar)


def back_and_forth(maze, pos, config, rng) -> str:
    """Away from the start along its first open direction, then back, and again."""
    if pos == maze.start:
        return format_action(move(_open(maze, pos)), config.grammar)
    back = next(d for d in range(4) if step_pos(maze, pos, d) == maze.start)
    return format_action(move(back), config.grammar)


def stopper(maze, pos, config, rng) -> str:
    return "stop"


# ---------------------------------------------------------------- failure reasons


@pytest.mark.parametrize(("policy", "config", "reason"), [
    (SCRIPTED["oracle"], CONFIG, "solved"),
    (babble, CONFIG, "parse error"),
    (bump, CONFIG, "wall bump"),
    (back_and_forth, CONFIG, "loop"),
    (stopper, CONFIG, "stopped"),
    (SCRIPTED["oracle"], MazeConfig(size=5, max_turns=3), "turn budget"),  # paths are 4 moves
])
def test_failure_reason_of_scripted_episodes(policy, config: MazeConfig, reason: str) -> None:
    ep = _play(policy, config)
    assert failure_reason(ep) == reason
    assert failure_reason(episode_summary(ep)) == reason  # a step record's form, the same answer
    assert reason == "solved" or reason in FAILURE_REASONS


def test_wasted_turns_counts_and_ties() -> None:
    ep = _play(back_and_forth)
    assert wasted_turns(ep) == {"parse error": 0, "wall bump": 0, "loop": 5}  # 6 turns, 1 new
    record = episode_summary(_play(babble))
    maze_pos = record["positions"][0]
    # one parse error and one bump: a tie goes to the parse error
    tie = record | {"actions": ["invalid", "move:0"], "replies": ["x", "right"],
                    "positions": [maze_pos, maze_pos, maze_pos], "feedback": ["", ""]}
    assert wasted_turns(tie) == {"parse error": 1, "wall bump": 1, "loop": 0}
    assert failure_reason(tie) == "parse error"


# ---------------------------------------------------------------- episodes and widgets


def test_turn_rows_and_frames_follow_the_episode() -> None:
    ep = _play(SCRIPTED["oracle"])
    rows = turn_rows(ep)
    path = oracle_actions(_maze(ep))
    assert [r["reply"] for r in rows] == [format_action(a, "keyword") for a in path]
    assert rows[-1]["reward"] == 1.0 and all(r["reward"] == 0.0 for r in rows[:-1])
    assert rows[0]["position"] == tuple(ep.positions[0]) and all(r["moved"] for r in rows)
    assert frame_png(ep, 1)[:8] == b"\x89PNG\r\n\x1a\n"
    assert frame_png(ep, 1) != frame_png(ep, 2)  # the agent moved


def _maze(ep):
    from workbench.envs import init_maze

    return init_maze(ep.init_state)


def test_trajectory_player_slider_changes_the_shown_turn() -> None:
    ep = _play(back_and_forth)
    player = trajectory_player(ep, px_per_cell=CONFIG.px_per_cell)
    assert player.slider.min == 1 and player.slider.max == ep.turns
    assert "turn 1 of 6" in player.text.value and repr(ep.replies[0]) in player.text.value
    first_image = player.image.value
    player.slider.value = 2
    assert "turn 2 of 6" in player.text.value
    assert repr(ep.replies[1]) in player.text.value and "move" in player.text.value
    assert player.image.value != first_image  # turn 2 starts one square away
    player.play.value = 3  # the play button drives the slider
    assert player.slider.value == 3 and "turn 3 of 6" in player.text.value
    assert "application/vnd.jupyter.widget-view+json" in player._repr_mimebundle_()


def test_player_shows_parse_errors_and_wall_bumps() -> None:
    text = trajectory_player(_play(babble)).text.value
    assert "action: invalid" in text and "Cannot parse" in text
    assert "(no move)" in trajectory_player(_play(bump)).text.value


def test_group_view_shares_one_slider_and_ends_short_episodes() -> None:
    short, long = _play(SCRIPTED["oracle"]), _play(back_and_forth)
    view = group_view([short, long], advantages_G=[1.0, -1.0])
    assert view.slider.max == 6 and len(view.images) == 2
    assert "advantage +1" in view.headers[0].value and "solved" in view.headers[0].value
    view.slider.value = 6
    assert "ended after 4 turns" in view.texts[0].value
    assert "turn 6 of 6" in view.texts[1].value


def _run_folder(root: Path) -> Path:
    """A run folder as train() leaves it, written by hand: config, metrics, two step records."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps(to_dict(RunConfig())))
    rows = [{"step": 0, "eval/greedy_solved": 1.0, "eval/n_mazes": 4, "eval/ceiling": 4},
            {"step": 1, "reward/mean": 0.25, "time/step": 1.0},
            {"step": 2, "reward/mean": 0.5, "time/step": 1.5}]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups = [[_play(SCRIPTED["oracle"], state_index=p), _play(babble, state_index=p)]
              for p in range(2)]
    for step in (1, 2):
        folder = root / "steps" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        record = {"episodes_P_G": [[episode_summary(ep) for ep in g] for g in groups],
                  "advantages_P_G": [[0.7, -0.7], [0.7, -0.7]], "step": step}
        (folder / "episodes.json").write_text(json.dumps(record))
    return root


def test_step_inspector_reads_a_run_folder_and_replays(tmp_path: Path) -> None:
    calls = []

    def fake_replay(run_dir: Path, step: int):
        calls.append((run_dir, step))
        same = {"update/loss": 0.125}
        return SimpleNamespace(step=step, from_checkpoint=0, logged=same, replayed=same,
                               exact=True)

    insp = step_inspector(_run_folder(tmp_path / "run"), replay_fn=fake_replay)
    assert list(insp.step.options) == [1, 2] and insp.step.value == 2
    assert "reward/mean" in insp.metrics.value and "0.5" in insp.metrics.value
    assert insp.group.max == 1 and len(insp.view.images) == 2
    insp.step.value = 1
    assert "0.25" in insp.metrics.value
    insp.group.value = 1
    assert insp.episodes.children == (insp.view.widget,)
    insp.replay_button.click()
    assert calls == [(tmp_path / "run", 1)]
    assert "exact" in insp.replay_text.value and "0.125" in insp.replay_text.value


def test_step_inspector_needs_step_records(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="step records"):
        step_inspector(tmp_path)


# ---------------------------------------------------------------- plots


def test_plots_draw_from_records() -> None:
    rows = [{"step": s, "reward/mean": 0.1 * s, "rollout/success_rate": 0.05 * s,
             "rollout/zero_variance_frac": 0.5, "time/rollout": 1.0, "time/update": 2.0,
             "time/weight_sync": 0.01, "time/step": 3.5} for s in (1, 2, 3)]
    rows[0] |= {"rollout/wall_bump_rate": 0.4, "rollout/invalid_rate": 0.0,
                "rollout/entropy": 0.5}
    rows.append({"step": 3, "eval/greedy_solved": 4.0, "eval/ceiling": 7, "eval/n_mazes": 8})
    fig = plot_training(rows)
    rollouts, behaviour, evals = fig.axes[:3]
    assert [line.get_label() for line in rollouts.get_lines()] == ["reward mean", "success"]
    assert {"wall bumps / turn", "invalid replies / turn"} <= {
        line.get_label() for line in behaviour.get_lines()}
    assert [line.get_label() for line in evals.get_lines()] == ["eval greedy", "oracle ceiling"]
    band = evals.collections[0].get_paths()[0].vertices[:, 1]  # the 95% band around 4/8
    half = noise_band(4.0, 8)
    assert math.isclose(half, 1.96 * 8 * math.sqrt(0.25 / 8))
    assert math.isclose(band.min(), 4.0 - half) and math.isclose(band.max(), 4.0 + half)
    bars = plot_phase_times(rows).axes[0].patches
    assert len(bars) == 4 * 3 and math.isclose(bars[-1].get_height(), 0.49)  # "other"
    adv = np.array([[0.0, 0.0, 0.0], [1.0, -0.5, -0.5]])
    fig = plot_advantages(adv, np.array([[1, 1, 1], [1, 0, 0]]))
    assert "zero variance" in fig.axes[0].get_title() and "zero" not in fig.axes[1].get_title()
    fig = plot_logprob_scatter(np.array([-1.0, -2.0]), np.array([-1.0, -2.0 + 1e-6]))
    assert fig.axes[0].get_title().startswith("2 reply tokens, max |diff| 1.0e-06")
    assert len(plot_grad_norms({"layers.0.mlp.up_proj": 0.1, "visual.x": 0.2}).axes[0].patches) == 2


# ---------------------------------------------------------------- notebook helpers


def test_record_metrics_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    values = {"rewards_P_G": np.array([[0.5, 1.0]]), "n": np.int64(3), "flag": True,
              "nested": {"a": (1, 2)}, "bad": float("nan")}
    record_metrics(values, tmp_path / "nb" / "metrics.json")
    assert "recorded 5 metrics" in capsys.readouterr().out
    assert read_recorded(tmp_path / "nb" / "metrics.json") == jsonable(values) == {
        "rewards_P_G": [[0.5, 1.0]], "n": 3, "flag": True, "nested": {"a": [1, 2]}, "bad": "nan"}


def test_comparable_drops_timings() -> None:
    assert comparable([{"step": 1, "time/step": 2.0, "reward/mean": 0.5}]) == [
        {"step": 1, "reward/mean": 0.5}]


def test_module_names_and_ratio_stats() -> None:
    lora = "base_model.model.model.language_model.layers.3.mlp.up_proj.lora_B.default.weight"
    assert module_name(lora) == "layers.3.mlp.up_proj"
    assert module_name("base_model.model.model.visual.blocks.0.attn.qkv.weight") == \
        "visual.blocks.0.attn.qkv"
    stats = ratio_stats(np.log([0.5, 0.5]), np.log([0.5, 0.7]), LossConfig())
    assert stats["tokens"] == 2 and math.isclose(stats["ratio_max"], 1.4)
    assert stats["clip_fraction"] == 0.5 and stats["ratio_min"] == 1.0
