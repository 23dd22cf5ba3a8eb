"""ipywidgets viewers of episodes and run folders: a trajectory player, a group view, a step
inspector, a token view. They read records (Episodes, episode summaries, a run directory, a
token table), never a trainer.

    trajectory_player(episode)                 # play / slider over turns: image, reply, action
    group_view(ro.episodes_P_G[0], adv_P_G[0]) # the G episodes of one maze side by side
    step_inspector("runs/grpo")                # pick a step: its metrics, episodes, replay
    token_view(episode, table)                 # per turn: the image, its reply tokens' log-probs

Each returns a small dataclass holding the widget and its parts, so a test can move a slider and
read what is shown without a browser (ipywidgets 8). A notebook cell displays a viewer as two
outputs: a static picture first (`viewer.png()`: the episode's frames as one strip, the group's
episodes on their mazes; the token view: per turn, the image beside its tokens' log-probs and
ratios; the step inspector adds the step's metrics as HTML), then the live widget, whose
text/plain is one line (`viewer.summary()`) instead of the widget's repr. A live JupyterLab
shows the picture and the widget; a front end that does not draw the widget view shows the
picture and the line (its text/plain): JupyterLab on an untrusted notebook (a clone, a
download, a papermill output), nbconvert's HTML without widget state, GitHub.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from workbench.deps import require
from workbench.envs import InitState, init_maze, render_image
from workbench.viz.episodes import (
    EpisodeLike,
    as_record,
    episode_strip_png,
    figure_png,
    frame_png,
    grid_figure,
    turn_rows,
)

if TYPE_CHECKING:
    from workbench.rl.inspect import TokenTable


def png_bundle(png: bytes, alt: str) -> dict[str, str]:
    """A display bundle of a PNG (base64, as a notebook stores it) with a text fallback."""
    return {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": alt}


def widget_bundle(widget: Any, text: str, png: bytes | None = None) -> dict[str, Any]:
    """The widget's display bundle (ipywidgets 8: the view's model id, and the widget's repr
    `VBox(children=(HBox(...` as text/plain) with `text` as its text/plain, and `png`, when
    given, as its image/png."""
    bundle = widget._repr_mimebundle_() | {"text/plain": text}
    if png is not None:
        bundle["image/png"] = base64.b64encode(png).decode("ascii")
    return bundle


class _Displayed:
    """Displayed by IPython as its static outputs (`static_outputs`: the picture), then its
    live `widget` with `summary()` as text/plain. The picture is an output of its own, not an
    image/png in the widget's bundle: JupyterLab shows a trusted notebook's widget view even
    when the model is gone (no kernel), and nbconvert does when the widget state was saved,
    so that image would be hidden; front ends that skip the view (an untrusted notebook,
    nbconvert without widget state, GitHub) would show it instead of the line."""

    widget: Any

    def png(self) -> bytes:
        """The static picture."""
        raise NotImplementedError

    def summary(self) -> str:
        """One line: what the viewer shows, and that running the cell makes it live."""
        raise NotImplementedError

    def static_outputs(self) -> list[dict[str, str]]:
        """Display bundles shown above the widget (the saved notebook's pictures)."""
        raise NotImplementedError

    def _ipython_display_(self) -> None:
        from IPython.display import display

        for bundle in self.static_outputs():
            display(bundle, raw=True)
        display(widget_bundle(self.widget, self.summary()), raw=True)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """One bundle, for front ends that do not call `_ipython_display_`: the live widget,
        the picture where the widget cannot be shown, the summary line as text."""
        return widget_bundle(self.widget, self.summary(), self.png())


_LIVE = " \N{EM DASH} run the cell to "


def _maze(record: dict[str, Any]) -> str:
    state = record["init_state"]
    return f"maze {state['maze_seed']} ({state['size']}x{state['size']})"


def turn_html(row: dict[str, Any]) -> str:
    """One turn as HTML: turn, position, raw reply, parsed action, feedback, reward."""
    moved = "" if row["moved"] else " (no move)"
    return (f"<b>turn {row['turn']} of {row['turns']}</b> at {row['position']}<br>"
            f"reply: <code>{html.escape(repr(row['reply']), quote=False)}</code><br>"
            f"action: {row['action']}{moved}<br>feedback: {html.escape(row['feedback'])}<br>"
            f"reward: {row['reward']:.3g}")


@dataclass
class Player(_Displayed):
    """A trajectory player: Play button and slider over turns, the image, the turn's text."""

    widget: Any
    slider: Any
    play: Any
    image: Any
    text: Any
    rows: list[dict[str, Any]]
    record: dict[str, Any]  # the episode's summary (workbench.rl.rollout.episode_summary)

    def png(self, frame_px: int = 96, cols: int = 10) -> bytes:
        """The static picture: every frame of the episode in one labelled strip."""
        return episode_strip_png(self.record, frame_px, cols)

    def summary(self) -> str:
        rec, n = self.record, len(self.rows)
        outcome = "solved" if rec["success"] else "failed"
        return (f"trajectory player: {_maze(rec)}, {n} turns ({n + 1} frames), {outcome}, "
                f"reward {rec['reward']:.3g}{_LIVE}step through the turns")

    def static_outputs(self) -> list[dict[str, str]]:
        n = len(self.rows)
        return [png_bundle(self.png(), f"<episode: {n} turns, frames 1..{n + 1}>")]


def _frames(episode: dict[str, Any], px_per_cell: int) -> Callable[[int], bytes]:
    cache: dict[int, bytes] = {}

    def frame(turn: int) -> bytes:
        if turn not in cache:
            cache[turn] = frame_png(episode, turn, px_per_cell)
        return cache[turn]
    return frame


def trajectory_player(episode: EpisodeLike, px_per_cell: int = 32, width: int = 224) -> Player:
    """Step through one episode: the image the model saw, its raw reply, the parsed action, the
    environment's feedback and the reward, turn by turn."""
    w = require("ipywidgets")
    rec = as_record(episode)
    rows, frame = turn_rows(rec), _frames(rec, px_per_cell)
    slider = w.IntSlider(value=1, min=1, max=len(rows), description="turn")
    play = w.Play(value=1, min=1, max=len(rows), interval=800, description="play")
    w.link((play, "value"), (slider, "value"))
    image = w.Image(value=frame(1), format="png", width=width)
    text = w.HTML(turn_html(rows[0]))

    def show(change: dict[str, Any]) -> None:
        image.value = frame(change["new"])
        text.value = turn_html(rows[change["new"] - 1])
    slider.observe(show, names="value")
    box = w.VBox([w.HBox([play, slider]), w.HBox([image, text])])
    return Player(box, slider, play, image, text, rows, rec)


@dataclass
class GroupView(_Displayed):
    """G episodes of one maze side by side, one turn slider for all."""

    widget: Any
    slider: Any
    images: list[Any]
    texts: list[Any]
    headers: list[Any]
    records_G: list[dict[str, Any]]  # the episodes' summaries
    advantages_G: np.ndarray  # float (G,), zeros when none were given

    def figure(self, title: str = "") -> Any:
        """The G episodes on their maze (a bare matplotlib Figure), titled with sample, reward
        and advantage."""
        titles = [f"sample {g}: reward {r['reward']:.2g}, adv {a:+.2f}"
                  for g, (r, a) in enumerate(zip(self.records_G, self.advantages_G))]
        fig = grid_figure(self.records_G, titles, cols=4, panel_in=2.6, pyplot=False)
        if title:
            fig.suptitle(title, fontsize=10)
        return fig

    def png(self, title: str = "") -> bytes:
        """The static picture: `figure` as PNG."""
        return figure_png(self.figure(title))

    def summary(self) -> str:
        solved = sum(bool(r["success"]) for r in self.records_G)
        adv = self.advantages_G
        return (f"group view: {len(self.records_G)} episodes of {_maze(self.records_G[0])}, "
                f"{solved} solved, advantages {adv.min():+.2f} to {adv.max():+.2f}"
                f"{_LIVE}step through the turns")

    def static_outputs(self) -> list[dict[str, str]]:
        return [png_bundle(self.png(), f"<group of {len(self.records_G)} episodes>")]


def _column_html(rows: list[dict[str, Any]], turn: int) -> str:
    if turn > len(rows):
        return f"<i>ended after {len(rows)} turns</i>"
    return turn_html(rows[turn - 1])


def group_view(episodes_G: list[EpisodeLike], advantages_G: Any = None, px_per_cell: int = 32,
               width: int = 150) -> GroupView:
    """The G episodes of one maze in columns (header: reward, advantage, outcome) with a shared
    turn slider; an episode that ended earlier shows its last position."""
    w = require("ipywidgets")
    recs = [as_record(ep) for ep in episodes_G]
    rows_G = [turn_rows(r) for r in recs]
    frames = [_frames(r, px_per_cell) for r in recs]
    adv_G = np.zeros(len(recs)) if advantages_G is None else np.asarray(advantages_G, float)
    slider = w.IntSlider(value=1, min=1, max=max(len(r) for r in rows_G), description="turn")
    headers = [w.HTML(f"<b>sample {g}</b>: {'solved' if r['success'] else 'failed'}<br>"
                      f"reward {r['reward']:.3g}, advantage {a:+.3g}")
               for g, (r, a) in enumerate(zip(recs, adv_G))]
    images = [w.Image(value=f(1), format="png", width=width) for f in frames]
    texts = [w.HTML(_column_html(rows, 1), layout=w.Layout(width=f"{width + 20}px"))
             for rows in rows_G]

    def show(change: dict[str, Any]) -> None:
        for g, rows in enumerate(rows_G):
            images[g].value = frames[g](min(change["new"], len(rows) + 1))
            texts[g].value = _column_html(rows, change["new"])
    slider.observe(show, names="value")
    columns = [w.VBox([h, i, t]) for h, i, t in zip(headers, images, texts)]
    return GroupView(w.VBox([slider, w.HBox(columns)]), slider, images, texts, headers, recs,
                     adv_G)


def step_metrics(run_dir: str | Path, step: int) -> dict[str, Any]:
    """Every metrics.jsonl value logged for `step` (the training row and its evaluation)."""
    from workbench.run import read_metrics

    merged: dict[str, Any] = {}
    for row in read_metrics(run_dir):
        if row["step"] == step:
            merged |= row
    return merged


def recorded_steps(run_dir: str | Path) -> list[int]:
    """Steps that have a step record (steps/step_NNNNNN/episodes.json)."""
    folders = Path(run_dir).glob("steps/step_*/episodes.json")
    return sorted(int(f.parent.name.removeprefix("step_")) for f in folders)


def _metrics_html(values: dict[str, Any], columns: int = 1) -> str:
    """A table of metric, value pairs, `columns` pairs per row."""
    cells = [f"<td>{html.escape(k)}</td><td>{v:.4g}</td>" if isinstance(v, float)
             else f"<td>{html.escape(k)}</td><td>{html.escape(str(v))}</td>"
             for k, v in values.items()]
    rows = ["".join(cells[i:i + columns]) for i in range(0, len(cells), columns)]
    return "<table>" + "".join(f"<tr>{r}</tr>" for r in rows) + "</table>"


def replay_html(result: Any) -> str:
    """A ReplayResult as a table: each update metric logged vs replayed, and the verdict."""
    cells = "".join(f"<tr><td>{k}</td><td>{result.logged[k]!r}</td>"
                    f"<td>{result.replayed[k]!r}</td></tr>" for k in result.logged)
    verdict = "exact" if result.exact else "DIFFERENT"
    return (f"<b>step {result.step} replayed from checkpoint {result.from_checkpoint}: "
            f"{verdict}</b><table><tr><th>metric</th><th>logged</th><th>replayed</th></tr>"
            f"{cells}</table>")


@dataclass
class StepInspector(_Displayed):
    """Pick a recorded step of a run: its metrics, the episodes of one of its groups, replay."""

    widget: Any
    step: Any  # Dropdown of recorded steps
    group: Any  # IntSlider over the step's mazes
    metrics: Any  # HTML table of the step's metrics
    episodes: Any  # VBox holding the current GroupView's widget
    replay_button: Any
    replay_text: Any
    run_dir: Path
    view: GroupView | None = field(default=None)

    def _caption(self) -> str:
        return f"step {self.step.value}, maze {self.group.value}"

    def png(self) -> bytes:
        """The static picture: the shown group's episodes (GroupView.png), captioned."""
        assert self.view is not None, "step_inspector sets the view"
        return self.view.png(title=f"{self._caption()}: the group's samples")

    def summary(self) -> str:
        steps = list(self.step.options)
        return (f"step inspector: {self.run_dir.name}, steps {steps[0]}..{steps[-1]}, showing "
                f"{self._caption()}{_LIVE}pick a step and a maze, and replay")

    def static_outputs(self) -> list[dict[str, str]]:
        values = step_metrics(self.run_dir, self.step.value)
        head = f"<b>{self._caption()}</b> of {html.escape(str(self.run_dir))}"
        return [{"text/html": head + _metrics_html(values, columns=3),
                 "text/plain": f"{self._caption()}: {len(values)} metrics"},
                png_bundle(self.png(), f"<{self._caption()}: its group's episodes>")]


def _px_per_cell(run_dir: Path) -> int:
    config = json.loads((run_dir / "config.json").read_text())
    return int(config["env"]["px_per_cell"])


def step_inspector(run_dir: str | Path, replay_fn: Callable[..., Any] | None = None,
                   width: int = 130) -> StepInspector:
    """A viewer over a run folder (finished or still running): pick a step to see its metrics
    and each group's episodes with their advantages; the button replays the step's update
    (`workbench.rl.replay.replay`) and shows logged vs replayed values."""
    w = require("ipywidgets")
    run_dir = Path(run_dir)
    steps = recorded_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"{run_dir} has no step records (trainer.keep_step_records)")
    px = _px_per_cell(run_dir)
    insp = StepInspector(None, w.Dropdown(options=steps, value=steps[-1], description="step"),
                         w.IntSlider(value=0, min=0, max=0, description="maze"), w.HTML(),
                         w.VBox(), w.Button(description="replay this step"), w.HTML(), run_dir)

    def show_group(_: Any = None) -> None:
        from workbench.run import load_step_record

        record = load_step_record(run_dir / "steps" / f"step_{insp.step.value:06d}")
        p = min(insp.group.value, len(record["episodes_P_G"]) - 1)
        insp.view = group_view(record["episodes_P_G"][p], record["advantages_P_G"][p], px, width)
        insp.episodes.children = (insp.view.widget,)

    def show_step(_: Any = None) -> None:
        from workbench.run import load_step_record

        record = load_step_record(run_dir / "steps" / f"step_{insp.step.value:06d}")
        insp.group.max = len(record["episodes_P_G"]) - 1
        insp.metrics.value = _metrics_html(step_metrics(run_dir, insp.step.value))
        insp.replay_text.value = ""
        show_group()

    def replay(_: Any) -> None:
        fn = replay_fn
        if fn is None:
            from workbench.rl.replay import replay

            fn = replay
        insp.replay_text.value = f"replaying step {insp.step.value} ..."
        insp.replay_text.value = replay_html(fn(run_dir, insp.step.value))

    insp.step.observe(show_step, names="value")
    insp.group.observe(show_group, names="value")
    insp.replay_button.on_click(replay)
    show_step()
    insp.widget = w.VBox([w.HBox([insp.step, insp.group, insp.replay_button]),
                          w.HBox([insp.metrics, insp.episodes]), insp.replay_text])
    return insp


def _tokens_html(rows: list[dict[str, Any]]) -> str:
    """One turn's tokens as a table: text, log-probs, ratios, clipped, advantage."""
    head = ("<tr><th>token</th><th>sampler</th><th>before</th><th>after</th><th>ratio before"
            "</th><th>ratio after</th><th>clipped</th><th>advantage</th></tr>")
    body = "".join(
        f"<tr><td><code>{html.escape(repr(r['text']))}</code> ({r['token']})</td>"
        f"<td>{r['sampler']:.4f}</td><td>{r['before']:.4f}</td><td>{r['after']:.4f}</td>"
        f"<td>{r['ratio_before']:.6f}</td><td>{r['ratio_after']:.4f}</td>"
        f"<td>{'<b>yes</b>' if r['clipped_after'] else 'no'}</td><td>{r['advantage']:+.3g}</td>"
        "</tr>" for r in rows)
    return f"<table>{head}{body}</table>"


@dataclass
class TokenView(_Displayed):
    """One episode's reply tokens turn by turn: the turn's image beside its tokens' sampler and
    trainer log-probs (before and after the update), ratios, clipping and advantage."""

    widget: Any
    slider: Any
    image: Any
    text: Any
    table: TokenTable
    record: dict[str, Any]  # the episode's summary

    def figure(self, max_turns: int = 8) -> Any:
        """One row per turn (the first `max_turns`): the image; per token, the sampler's and
        the trainer's log-probs before and after the update as bars; per token, the ratio
        after the update on the clip band, clipped tokens crossed (a bare matplotlib Figure)."""
        from matplotlib.figure import Figure

        from workbench.viz.palette import PALETTE

        table, turns = self.table, min(self.table.turns, max_turns)
        fig = Figure(figsize=(8.0, 1.4 * turns + 0.6), layout="constrained")
        grid = fig.add_gridspec(turns, 3, width_ratios=[1, 2.4, 2.4])
        image = _frame_arrays(self.record)
        bars = [("sampler", PALETTE["sampled"]), ("before", PALETTE["sft"]),
                ("after", PALETTE["grpo"])]
        for k in range(turns):
            rows, x = table.of_turn(k + 1), np.arange(len(table.of_turn(k + 1)))
            labels = [repr(r["text"])[:12] if r["text"] else str(r["token"]) for r in rows]
            thumb = fig.add_subplot(grid[k, 0])
            thumb.imshow(image(k + 1))
            thumb.set_axis_off()
            thumb.set_title(f"turn {k + 1}, adv {rows[0]['advantage']:+.2f}", fontsize=8)
            lp = fig.add_subplot(grid[k, 1])
            for j, (key, colour) in enumerate(bars):
                lp.bar(x + (j - 1) * 0.27, [r[key] for r in rows], 0.27, color=colour,
                       label=f"log-prob {key}" if k == 0 else None)
            lp.set_xticks(x, labels, fontsize=7)
            lp.tick_params(labelsize=7)
            lp.set_ylabel("log-prob", fontsize=7)
            ratio = fig.add_subplot(grid[k, 2])
            ratio.axhspan(1 - table.clip_low, 1 + table.clip_high, color="#eeeeee", zorder=0)
            ratio.axhline(1.0, color=PALETTE["diagonal"], lw=0.8, zorder=1)
            ratio.plot(x, [r["ratio_after"] for r in rows], "o", color=PALETTE["loss"],
                       mfc="white", label="ratio after (clip band shaded)" if k == 0 else None)
            hits = [i for i, r in enumerate(rows) if r["clipped_after"]]
            ratio.plot(hits, [rows[i]["ratio_after"] for i in hits], "x", ms=9,
                       color=PALETTE["advantage_neg"], label="clipped" if k == 0 else None)
            ratio.set_xticks(x, labels, fontsize=7)
            ratio.set_xlim(-0.5, len(rows) - 0.5)
            ratio.tick_params(labelsize=7)
            ratio.set_ylabel("ratio", fontsize=7)
        shown = f"turns 1-{turns} of {table.turns}" if turns < table.turns else f"{turns} turns"
        fig.suptitle(f"{_maze(self.record)}, sample {table.sample}: {shown}", fontsize=9)
        fig.legend(loc="outside lower center", ncol=5, fontsize=7)
        return fig
    def png(self, max_turns: int = 8) -> bytes:
        """The static picture: `figure` as PNG."""
        return figure_png(self.figure(max_turns))

    def summary(self) -> str:
        s = self.table.stats()
        return (f"token view: {_maze(self.record)} sample {self.table.sample}, {s['tokens']} "
                f"tokens over {self.table.turns} turns, {s['clipped_after']} clipped after"
                f"{_LIVE}step through the turns")

    def static_outputs(self) -> list[dict[str, str]]:
        return [png_bundle(self.png(), f"<tokens of {self.table.turns} turns>")]


def _frame_arrays(record: dict[str, Any], px_per_cell: int = 16) -> Callable[[int], np.ndarray]:
    """The image the model saw before turn t (1-based), as an array, for an episode summary."""
    maze = init_maze(InitState.from_dict(record["init_state"]))
    return lambda t: render_image(maze, tuple(record["positions"][t - 1]), px_per_cell)


def token_view(episode: EpisodeLike, table: TokenTable, px_per_cell: int = 32,
               width: int = 160) -> TokenView:
    """Step through one episode's turns: the image it saw beside a table of its reply tokens
    (`workbench.rl.inspect.token_table`): sampler and trainer log-probs before and after the
    update, the ratios, whether PPO clipped the token, its advantage."""
    w = require("ipywidgets")
    rec = as_record(episode)
    frame = _frames(rec, px_per_cell)
    slider = w.IntSlider(value=1, min=1, max=max(table.turns, 1), description="turn")
    image = w.Image(value=frame(1), format="png", width=width)
    text = w.HTML(_tokens_html(table.of_turn(1)))

    def show(change: dict[str, Any]) -> None:
        image.value = frame(change["new"])
        text.value = _tokens_html(table.of_turn(change["new"]))
    slider.observe(show, names="value")
    return TokenView(w.VBox([slider, w.HBox([image, text])]), slider, image, text, table, rec)
