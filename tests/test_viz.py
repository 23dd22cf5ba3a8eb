"""Pictures, widgets and notebook helpers without a browser or a model: failure reasons of
scripted episodes, widget state after moving sliders (ipywidgets 8 runs without a front end),
the step inspector over a hand-made run folder, the viewers' static pictures (decoded, shown
by IPython's display machinery, kept by a notebook run through nbclient and nbconvert's HTML),
plots (labelled axes, legends, the palette), recorded metrics."""

from __future__ import annotations

import base64
import io
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import numpy as np
import pytest
from matplotlib.colors import same_color
from PIL import Image

from workbench.config import RunConfig, to_dict
from workbench.envs import (
    MazeConfig,
    eval_set,
    format_action,
    init_maze,
    oracle_actions,
    render_image,
)
from workbench.envs.actions import move
from workbench.envs.maze import step_pos
from workbench.envs.tasks import SCRIPTED
from workbench.notebook import comparable
from workbench.notebook_checks import jsonable, read_recorded, record_metrics
from workbench.rl import FAILURE_REASONS, failure_reason, play_scripted, wasted_turns
from workbench.rl.inspect import module_name, ppo_clipped, ratio_stats, token_table
from workbench.rl.rollout import episode_summary
from workbench.session.losses import LossConfig
from workbench.viz import (
    PALETTE,
    episode_grid,
    episode_strip,
    frame_png,
    group_by_layer,
    group_view,
    noise_band,
    plot_advantages,
    plot_grad_norms,
    plot_logprob_scatter,
    plot_phase_times,
    plot_training,
    step_inspector,
    token_view,
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


# ---------------------------------------------------------------- static pictures


def _decode(png: bytes | str) -> Image.Image:
    """A PNG (bytes, or base64 as a notebook stores it) decoded by PIL."""
    raw = base64.b64decode(png) if isinstance(png, str) else png
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return Image.open(io.BytesIO(raw))


def test_episode_strip_shows_every_frame_in_order() -> None:
    from workbench.viz.episodes import STRIP_LABEL_PX, STRIP_PAD

    ep = _play(SCRIPTED["oracle"])  # 4 turns: 5 frames, the last where it ended
    strip = episode_strip(ep, frame_px=50, cols=3)  # 10 px per cell, 3 frames per row
    side = 5 * 10
    tile_w, tile_h = side + 2 * STRIP_PAD, side + 2 * STRIP_PAD + STRIP_LABEL_PX
    assert strip.shape == (2 * tile_h, 3 * tile_w, 3)
    for k, pos in enumerate(ep.positions):
        y, x = (k // 3) * tile_h + STRIP_PAD, (k % 3) * tile_w + STRIP_PAD
        np.testing.assert_array_equal(strip[y:y + side, x:x + side],
                                      render_image(_maze(ep), pos, 10))
    player = trajectory_player(ep)
    image = _decode(player.png())  # default: 96 // 5 = 19 px per cell, one row of 5 frames
    assert image.size == (5 * (95 + 2 * STRIP_PAD), 95 + 2 * STRIP_PAD + STRIP_LABEL_PX)


def test_group_and_inspector_pictures(tmp_path: Path) -> None:
    view = group_view([_play(SCRIPTED["oracle"]), _play(babble)], advantages_G=[1.0, -1.0])
    fig = view.figure()
    mazes = [ax for ax in fig.axes if ax.images]
    assert len(mazes) == 2 and "adv +1.00" in mazes[0].get_title()
    assert "failed" in mazes[1].get_title()
    width, height = fig.get_size_inches() * 80
    assert _decode(view.png()).size == (round(width), round(height))  # figure_png: dpi 80
    insp = step_inspector(_run_folder(tmp_path / "run"))
    assert _decode(insp.png()).size == _decode(insp.view.png(title="x")).size


@pytest.fixture
def shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """An in-process IPython shell (what a kernel runs), its history in memory."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    yield InteractiveShell.instance(config=config)
    InteractiveShell.clear_instance()


def _displayed(shell, expression: str, **names) -> list[dict]:
    """The display outputs' data when a cell ends with `expression`."""
    from IPython.utils.capture import capture_output

    shell.user_ns.update(names)
    with capture_output() as captured:
        assert shell.run_cell(expression).success
    return [out.data for out in captured.outputs]


WIDGET = "application/vnd.jupyter.widget-view+json"


def _viewers(tmp_path: Path) -> list:
    """A trajectory player, a group view and a step inspector."""
    return [trajectory_player(_play(back_and_forth)),
            group_view([_play(SCRIPTED["oracle"]), _play(bump)], advantages_G=[1.0, -1.0]),
            step_inspector(_run_folder(tmp_path / "run"))]


def assert_one_line(text: str) -> None:
    """A viewer's text/plain: one line saying what it shows, not the widget's repr."""
    assert "\n" not in text and len(text) <= 160, text
    assert "VBox(" not in text and "children=" not in text and "run the cell to" in text


def test_viewer_bundles_are_one_line_a_picture_and_the_widget(tmp_path: Path) -> None:
    """A viewer's own mime bundle (front ends that do not call _ipython_display_): the live
    widget's view, its picture as image/png, and one line as text/plain."""
    player, view, insp = _viewers(tmp_path)
    for viewer in (player, view, insp):
        bundle = viewer._repr_mimebundle_()
        assert set(bundle) == {WIDGET, "image/png", "text/plain"}
        assert bundle[WIDGET]["model_id"] == viewer.widget.model_id
        assert base64.b64decode(bundle["image/png"]) == viewer.png()
        assert_one_line(bundle["text/plain"])
    assert player.summary().startswith("trajectory player: maze 0 (5x5), 6 turns (7 frames), "
                                       "failed, reward 0")
    assert view.summary().startswith("group view: 2 episodes of maze 0 (5x5), 1 solved, "
                                     "advantages -1.00 to +1.00")
    assert insp.summary().startswith("step inspector: run, steps 1..2, showing step 2, maze 0")


def test_displaying_a_viewer_shows_its_picture_then_the_widget(shell, tmp_path: Path) -> None:
    """Two outputs: the picture, then the widget's view with the one line as its text/plain
    (what a front end that cannot show the widget shows under the picture)."""
    player, view, insp = _viewers(tmp_path)
    picture, widget = _displayed(shell, "player", player=player)
    assert set(picture) == {"image/png", "text/plain"} and WIDGET not in picture
    assert base64.b64decode(picture["image/png"]) == player.png()
    assert widget == {WIDGET: player.widget._repr_mimebundle_()[WIDGET],
                      "text/plain": player.summary()}
    assert [WIDGET in d for d in _displayed(shell, "display(player)")] == [False, True]
    picture, widget = _displayed(shell, "view", view=view)
    assert sorted(picture) == ["image/png", "text/plain"]
    assert widget.keys() == {WIDGET, "text/plain"} and widget["text/plain"] == view.summary()
    metrics, picture, widget = _displayed(shell, "insp", insp=insp)
    assert "step 2, maze 0" in metrics["text/html"] and "reward/mean" in metrics["text/html"]
    assert _decode(picture["image/png"]).size[0] > 0
    assert widget.keys() == {WIDGET, "text/plain"} and widget["text/plain"] == insp.summary()
    for viewer in (player, view, insp):
        assert_one_line(viewer.summary())


def test_executed_notebook_html_shows_the_player_without_javascript(kernel: str) -> None:
    """A notebook cell shows a player of a scripted episode's summary (what a step record
    holds; the kernel then imports no torch); nbclient runs it, nbconvert's HTML has the strip."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    record = episode_summary(_play(SCRIPTED["oracle"]))
    cell = f"from workbench.viz import trajectory_player\ntrajectory_player({record!r})"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    NotebookClient(nb, kernel_name=kernel, timeout=60).execute()
    outputs = nb.cells[0].outputs
    assert [WIDGET in out.get("data", {}) for out in outputs] == [False, True]
    strip = _decode(outputs[0]["data"]["image/png"])  # the episode's 5 frames, as here
    np.testing.assert_array_equal(np.asarray(strip), episode_strip(record))
    line = outputs[1]["data"]["text/plain"]  # shown under the strip where the widget is not
    assert line == trajectory_player(record).summary()
    assert "application/vnd.jupyter.widget-state+json" in nb.metadata["widgets"]  # nbclient's
    html, _ = HTMLExporter().from_notebook_node(nb)  # the widget view, drawn by JavaScript
    images = re.findall(r'<img[^>]*src="data:image/png;base64,([^"]+)"', html)
    assert [_decode(b).size for b in images] == [strip.size]
    assert line not in html and "VBox(" not in html
    del nb.metadata["widgets"]  # saved without the widget state: nbconvert skips the view
    html, _ = HTMLExporter().from_notebook_node(nb)
    assert len(re.findall(r'<img[^>]*src="data:image/png;base64,', html)) == 1
    assert f"<pre>{line}</pre>" in html and "VBox(" not in html and "children=" not in html


# ---------------------------------------------------------------- plots


def _labelled(fig) -> list[str]:
    """Checks every axes: a colourbar has its label; an axes with its axis off holds an image
    (a maze) or nothing (an empty grid slot); every other axes has x and y labels. Every line,
    patch and collection drawn carries a label (none of matplotlib's "_child" defaults), and
    every label not starting with "_" (helpers of a labelled series) is in a legend. Returns
    the legend labels."""
    legends = [lg for lg in (*fig.legends, *(ax.get_legend() for ax in fig.axes)) if lg]
    shown = [t.get_text() for lg in legends for t in lg.get_texts()]
    for ax in fig.axes:
        if ax.get_label() == "<colorbar>":
            assert ax.get_ylabel() or ax.get_xlabel()
            continue
        if not ax.axison:
            assert ax.images or not ax.has_data()
        else:
            assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
        for artist in (*ax.lines, *ax.patches, *ax.collections):
            label = artist.get_label()
            assert not label.startswith("_child"), (ax.get_title(), artist)
            assert label.startswith("_") or label in shown, label
    return shown


def _rows() -> list[dict]:
    rows = [{"step": s, "reward/mean": 0.1 * s, "rollout/success_rate": 0.05 * s,
             "rollout/zero_variance_frac": 0.5, "time/rollout": 1.0, "time/update": 2.0,
             "time/weight_sync": 0.01, "time/step": 3.5, "update/loss": 0.1 * s,
             "update/grad_norm": 0.2, "update/kl_sampler_trainer": 1e-9} for s in (1, 2, 3, 4)]
    rows[0] |= {"rollout/wall_bump_rate": 0.4, "rollout/invalid_rate": 0.0,
                "rollout/entropy": 0.5}
    for key in ("update/loss", "update/grad_norm", "update/kl_sampler_trainer"):
        del rows[1][key]  # step 2 made no update: every group had zero reward variance
    rows.append({"step": 3, "eval/greedy_solved": 4.0, "eval/ceiling": 7, "eval/n_mazes": 8})
    return rows


def _labels(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_plot_training_labels_colours_and_gaps() -> None:
    fig = plot_training(_rows())
    rollouts, behaviour, evals, update = fig.axes[:4]
    shown = _labelled(fig)
    assert _labels(rollouts) == ["reward mean", "success rate"]
    assert same_color(rollouts.get_lines()[0].get_color(), PALETTE["reward"])
    assert {"wall bumps / turn", "invalid replies / turn"} <= set(_labels(behaviour))
    assert _labels(evals) == ["eval greedy", "oracle ceiling"]
    assert same_color(evals.get_lines()[0].get_color(), PALETTE["greedy"])
    assert {"entropy (nats / turn)", "95% binomial noise band", "KL sampler vs trainer",
            "no update (zero-variance batch)"} <= set(shown)
    band = evals.collections[0].get_paths()[0].vertices[:, 1]  # the 95% band around 4/8
    half = noise_band(4.0, 8)
    assert math.isclose(half, 1.96 * 8 * math.sqrt(0.25 / 8))
    assert math.isclose(band.min(), 4.0 - half) and math.isclose(band.max(), 4.0 + half)
    loss = next(line for line in update.get_lines() if line.get_label() == "loss")
    np.testing.assert_allclose(loss.get_ydata(), [0.1, np.nan, 0.3, 0.4])  # a gap, not 0
    rows = [{k: v for k, v in r.items() if not k.startswith(("update/", "eval/"))}
            for r in _rows()]  # a run without updates or evals: empty panels, still labelled
    fig = plot_training(rows)
    assert _labels(fig.axes[2]) == _labels(fig.axes[3]) == [] and "loss" not in _labelled(fig)


def test_small_plots_are_labelled() -> None:
    bars = plot_phase_times(_rows()).axes[0].patches
    assert len(bars) == 4 * 4 and math.isclose(bars[-1].get_height(), 0.49)  # "other"
    assert set(_labelled(plot_phase_times(_rows()))) == {"rollout", "update", "weight sync",
                                                          "other"}
    adv = np.array([[0.0, 0.0, 0.0], [1.0, -0.5, -0.5], [0.5, 0.5, -1.0]])
    fig = plot_advantages(adv, np.array([[1, 1, 1], [1, 0, 0], [1, 1, 0]]), cols=2)
    assert _labelled(fig) == ["advantage < 0", "advantage = 0", "advantage > 0"]
    assert "zero variance" in fig.axes[0].get_title() and "zero" not in fig.axes[1].get_title()
    assert not fig.axes[3].axison  # the empty fourth slot
    fig = plot_logprob_scatter(np.array([-1.0, -2.0]), np.array([-1.0, -2.0 + 1e-6]))
    assert fig.axes[0].get_title().startswith("2 reply tokens, max |diff| 1.0e-06")
    assert _labelled(fig) == ["reply token", "equal (y = x)"]


def test_episode_grid_has_a_legend_and_titles_clear_of_the_row_above() -> None:
    config = MazeConfig(size=7, max_turns=12)
    oracle = [g[0] for g in play_scripted(SCRIPTED["oracle"], config, eval_set(7, 6))]
    eps = [*oracle, _play(bump), _play(babble)]  # 2 rows of 4, as the notebooks draw them
    fig = episode_grid(eps, config, titles=[f"grpo sampled {k}" for k in range(8)])
    assert _labelled(fig) == ["start (agent)", "goal", "path",
                              "no move (wall bump or invalid reply)", "end: solved",
                              "end: failed"]
    mazes = [ax for ax in fig.axes if ax.images]
    assert len(mazes) == 8 and all(not ax.axison for ax in mazes)  # image axes, axis off
    for dpi in (72, 100):  # a notebook's inline figures, a script's savefig
        fig.set_dpi(dpi)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        titles = [ax.title.get_window_extent(renderer) for ax in mazes]
        boxes = [ax.get_window_extent(renderer) for ax in mazes]
        for i, title in enumerate(titles):
            assert not any(title.overlaps(b) for b in boxes), f"title {i} overlaps a maze"
            assert not any(title.overlaps(t) for j, t in enumerate(titles) if j != i)
        legend = fig.legends[0].get_window_extent(renderer)
        assert not any(legend.overlaps(b) for b in boxes + titles)


LANGUAGE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_grad_norms_are_a_heatmap_of_layers_by_module_type() -> None:
    norms = {f"layers.{i}.{m}": 0.1 * i + 0.01 * k for i in range(4)
             for k, m in enumerate(LANGUAGE)}  # the tiny model's 28 LoRA modules
    fig = plot_grad_norms(norms)
    _labelled(fig)
    heat, bar = fig.axes
    assert bar.get_label() == "<colorbar>" and "gradient norm" in bar.get_ylabel()
    assert [t.get_text() for t in heat.get_yticklabels()] == [f"layer {i}" for i in range(4)]
    assert [t.get_text() for t in heat.get_xticklabels()] == ["q", "k", "v", "o", "gate", "up",
                                                               "down"]
    assert min(t.get_fontsize() for t in heat.get_xticklabels() + heat.get_yticklabels()) >= 8
    np.testing.assert_allclose(heat.images[0].get_array(), [[0.1 * i + 0.01 * k
                                                            for k in range(7)] for i in range(4)])
    mixed = {"layers.1.mlp.up_proj": 0.1, "visual.blocks.0.attn.qkv": 0.2,
             "visual.merger.linear_fc1": 0.3}
    grids, others = group_by_layer(mixed)
    assert grids["layers"][:2] == (["layer 1"], ["up"]) and others == {
        "visual.merger.linear_fc1": 0.3}
    assert grids["visual.blocks"][:2] == (["vision block 0"], ["qkv"])
    fig = plot_grad_norms(mixed)
    assert len(fig.axes) == 4 and len(fig.axes[2].patches) == 1  # 2 heatmaps, bars, colourbar
    _labelled(fig)


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


def test_context_budget_plot_stacks_each_turn_under_the_limit() -> None:
    from workbench.viz import plot_context_budget

    rows = [{"turn": 0, "image_tokens": 0, "text_tokens": 19, "reply_tokens": 0, "context": 19},
            {"turn": 1, "image_tokens": 1, "text_tokens": 15, "reply_tokens": 4, "context": 39},
            {"turn": 2, "image_tokens": 1, "text_tokens": 51, "reply_tokens": 4, "context": 95}]
    fig = plot_context_budget(rows, 100)
    assert set(_labelled(fig)) == {"earlier turns", "image tokens", "text tokens",
                                   "reply tokens", "limit (100)"}
    bars = fig.axes[0].patches  # earlier, image, text, reply: one bar a turn each
    assert [b.get_height() for b in bars] == [0, 19, 39, 0, 1, 1, 19, 15, 51, 0, 4, 4]
    assert bars[-1].get_y() + bars[-1].get_height() == 95  # the context after turn 2
    assert fig.axes[0].get_lines()[0].get_ydata()[0] == 100


def _token_datum(advantage: float):
    """Two turns of two reply tokens each (ids 10-13), sampler log-prob log(0.5) on each."""
    from workbench.policy import Stream
    from workbench.session import Datum

    mask = [0, 1, 1, 0, 1, 1]
    stream = Stream(list(range(8, 14)), [0] * 6, mask, [np.log(0.5) * m for m in mask])
    return Datum(stream, tuple(advantage * m for m in mask), tuple(float(m) for m in mask))


def test_token_table_rows_and_ppo_clipping_by_advantage_sign() -> None:
    cfg = LossConfig()
    assert ppo_clipped(np.array([1.3, 1.3, 0.7, 0.7]), np.array([1.0, -1.0, 1.0, -1.0]),
                       cfg).tolist() == [True, False, False, True]
    datums = [_token_datum(1.0), _token_datum(-1.0)]
    before = [list(d.stream.logprobs_T) for d in datums]
    after = [[lp + np.log(1.3) for lp in d.stream.logprobs_T] for d in datums]
    for g, clipped in ((0, True), (1, False)):  # ratio 1.3: PPO clips it for A > 0 only
        table = token_table(datums, [(0, 0), (0, 1)], (0, g), before, after, cfg)
        assert [r["turn"] for r in table.rows] == [1, 1, 2, 2] and table.turns == 2
        assert [r["token"] for r in table.rows] == [9, 10, 12, 13]
        assert all(r["ratio_before"] == 1.0 and not r["clipped_before"] for r in table.rows)
        assert all(math.isclose(r["ratio_after"], 1.3) for r in table.rows)
        assert [r["clipped_after"] for r in table.rows] == [clipped] * 4
        assert table.stats()["clipped_after"] == 4 * clipped
    with pytest.raises(ValueError, match="drop_zero=False"):
        token_table(datums, [(0, 0), (0, 1)], (1, 0), before, after, cfg)


def test_token_view_shows_each_turns_tokens_beside_its_image() -> None:
    episode = _play(SCRIPTED["oracle"])
    datums = [_token_datum(1.0)]
    after = [[lp + np.log(1.3) for lp in d.stream.logprobs_T] for d in datums]
    table = token_table(datums, [(0, 0)], (0, 0), [list(datums[0].stream.logprobs_T)], after,
                        LossConfig())
    view = token_view(episode, table)
    assert view.slider.max == 2 and view.image.value == frame_png(episode, 1, 32)
    view.slider.value = 2
    assert view.image.value == frame_png(episode, 2, 32) and "<b>yes</b>" in view.text.value
    fig = view.figure()
    assert sum(bool(ax.images) for ax in fig.axes) == 2 and "turn 2" in fig.axes[3].get_title()
    assert _decode(view.png()).size[0] > 0
    assert_one_line(view.summary())
    assert view.summary().startswith("token view: maze 0 (5x5) sample 0, 4 tokens over 2 turns")
