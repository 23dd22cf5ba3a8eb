"""Episodes as pictures and per-turn rows: drawn on their mazes, frame by frame, or as one strip
of every frame (the static picture a trajectory player leaves in a saved notebook).

Every function takes an `Episode` or its summary dict (`workbench.rl.rollout.episode_summary`,
what a step record's episodes.json holds), so the same pictures serve a live rollout and a run
folder.

    fig = episode_grid(episodes, MazeConfig(size=7)); fig.savefig("episodes.png")
    Path("strip.png").write_bytes(episode_strip_png(episode))   # turn 1 .. the end, labelled
    turn_rows(episode)[0]   # {"turn": 1, "reply": "up", "action": "move up", ...}
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from workbench.deps import require
from workbench.envs import DIRECTIONS, InitState, MazeConfig, init_maze, render_image
from workbench.viz.palette import PALETTE

if TYPE_CHECKING:  # workbench.rl imports torch; viewers of summary dicts do without it
    from workbench.rl.rollout import Episode

EpisodeLike: TypeAlias = "Episode | dict[str, Any]"


def as_record(episode: EpisodeLike) -> dict[str, Any]:
    """The episode's summary dict (an Episode is summarised; a dict is returned as it is)."""
    if isinstance(episode, dict):
        return episode
    from workbench.rl.rollout import episode_summary

    return episode_summary(episode)


def action_text(action: str) -> str:
    """"move:1" -> "move up"; "stop" and "invalid" unchanged."""
    kind, _, direction = action.partition(":")
    return f"move {DIRECTIONS[int(direction)]}" if direction else kind


def turn_rows(episode: EpisodeLike) -> list[dict[str, Any]]:
    """One row per turn: where the agent stood (what it saw), its raw reply, the parsed action,
    the feedback, and the reward (the episode reward on the last turn, 0 before)."""
    rec = as_record(episode)
    n = len(rec["replies"])
    return [{"turn": t + 1, "turns": n, "position": tuple(rec["positions"][t]),
             "reply": rec["replies"][t], "action": action_text(rec["actions"][t]),
             "feedback": rec["feedback"][t],
             "reward": rec["reward"] if t == n - 1 else 0.0,
             "moved": rec["positions"][t + 1] != rec["positions"][t]} for t in range(n)]


def frame_png(episode: EpisodeLike, turn: int, px_per_cell: int = 32) -> bytes:
    """PNG of the image the model saw before its reply at `turn` (1-based); turn = turns + 1
    is where it ended."""
    rec = as_record(episode)
    maze = init_maze(InitState.from_dict(rec["init_state"]))
    return png_bytes(render_image(maze, tuple(rec["positions"][turn - 1]), px_per_cell))


STRIP_PAD = 4
"""White margin (pixels) around each frame of an episode strip (the last frame's border)."""
STRIP_LABEL_PX = 30
"""Height (pixels) of the two label lines under each frame of an episode strip."""


def _label(draw: Any, xy: tuple[int, int], text: str, width: int, font: Any, fill: str) -> None:
    """`text` at `xy`, cut with "..." to fit `width` pixels."""
    while len(text) > 1 and font.getlength(text) > width:
        text = text[: -4 if text.endswith("...") else -1].rstrip() + "..."
    draw.text(xy, text, font=font, fill=fill)


def _labels(rec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(first line, second line, its colour) under each frame: turn and reply, then the end."""
    colour = {"invalid": PALETTE["invalid"], "stuck": PALETTE["wall_bump"], "moved": "black"}
    out = []
    for row in turn_rows(rec):
        kind = "invalid" if row["action"] == "invalid" else "moved" if row["moved"] else "stuck"
        out.append((f"turn {row['turn']}", repr(row["reply"]), colour[kind]))
    verdict = "solved" if rec["success"] else "failed"
    out.append(("end", f"{verdict}, reward {rec['reward']:.2g}",
                PALETTE["end_solved" if rec["success"] else "end_failed"]))
    return out


def episode_strip(episode: EpisodeLike, frame_px: int = 96, cols: int = 10) -> np.ndarray:
    """Every frame of an episode as one RGB image (H, W, 3), `cols` frames per row: the image
    the model saw before each turn, then where it ended. Under each frame its turn and raw reply
    (in the palette's wall-bump / invalid colour when the agent did not move); the last frame is
    framed in the solved / failed colour. A frame is `frame_px // size` pixels per cell."""
    pil, draw_mod, font_mod = (require(m) for m in ("PIL.Image", "PIL.ImageDraw", "PIL.ImageFont"))
    rec = as_record(episode)
    maze = init_maze(InitState.from_dict(rec["init_state"]))
    px = max(4, frame_px // maze.walls_HW.shape[0])
    frames = [render_image(maze, tuple(p), px) for p in rec["positions"]]  # turns + 1 frames
    side = frames[0].shape[0]
    tile_w, tile_h = side + 2 * STRIP_PAD, side + 2 * STRIP_PAD + STRIP_LABEL_PX
    cols = max(1, min(cols, len(frames)))
    rows = (len(frames) + cols - 1) // cols
    canvas = pil.new("RGB", (cols * tile_w, rows * tile_h), "white")
    draw, font = draw_mod.Draw(canvas), font_mod.load_default()
    end = PALETTE["end_solved" if rec["success"] else "end_failed"]
    for k, (frame, (head, reply, colour)) in enumerate(zip(frames, _labels(rec))):
        x, y = (k % cols) * tile_w, (k // cols) * tile_h
        if k == len(frames) - 1:
            draw.rectangle((x + 1, y + 1, x + tile_w - 2, y + side + 2 * STRIP_PAD - 2),
                           outline=end, width=STRIP_PAD - 1)
        canvas.paste(pil.fromarray(frame), (x + STRIP_PAD, y + STRIP_PAD))
        text_y = y + side + 2 * STRIP_PAD
        _label(draw, (x + 2, text_y), head, tile_w - 4, font, "black")
        _label(draw, (x + 2, text_y + STRIP_LABEL_PX // 2), reply, tile_w - 4, font, colour)
    return np.asarray(canvas)


def png_bytes(image_HW3: np.ndarray) -> bytes:
    """An RGB uint8 array as PNG bytes."""
    buf = io.BytesIO()
    require("PIL.Image").fromarray(image_HW3).save(buf, format="PNG")
    return buf.getvalue()


def episode_strip_png(episode: EpisodeLike, frame_px: int = 96, cols: int = 10) -> bytes:
    """`episode_strip` as PNG bytes: the static picture of a trajectory player."""
    return png_bytes(episode_strip(episode, frame_px, cols))


def _centre(pos: tuple[int, int], px: int) -> tuple[float, float]:
    return (pos[1] + 0.5) * px, (pos[0] + 0.5) * px


def draw_episode(ax: Any, episode: EpisodeLike, config: MazeConfig | None = None) -> None:
    """The maze with the agent at its start, the path taken, turns without a move (wall bumps,
    invalid replies) and the end, each marker labelled for a legend (`ax.legend()`)."""
    rec, px = as_record(episode), config.px_per_cell if config else 16
    state = InitState.from_dict(rec["init_state"])
    maze = init_maze(state)
    positions = [tuple(p) for p in rec["positions"]]
    ax.imshow(render_image(maze, maze.start, px))
    xs, ys = zip(*(_centre(p, px) for p in positions))
    ax.plot(xs, ys, "-", color=PALETTE["path"], lw=2, alpha=0.8, label="path")
    stuck = [positions[t + 1] for t, a in enumerate(rec["actions"])
             if a == "invalid" or positions[t + 1] == positions[t]]
    if stuck:
        sx, sy = zip(*(_centre(p, px) for p in stuck))
        ax.plot(sx, sy, "x", color=PALETTE["stuck"], ms=8, mew=2, label=NO_MOVE)
    ex, ey = _centre(positions[-1], px)
    end = "end_solved" if rec["success"] else "end_failed"
    ax.plot([ex], [ey], "o", mfc="none", mec=PALETTE[end], ms=14, mew=3,
            label=END_LABELS[end])
    verdict = "solved" if rec["success"] else "failed"
    ax.set_title(f"seed {state.maze_seed}: {verdict} in {rec['turns']}", fontsize=9)
    ax.axis("off")  # an image axes: the maze is the picture, its outer wall the frame


NO_MOVE = "no move (wall bump or invalid reply)"
END_LABELS = {"end_solved": "end: solved", "end_failed": "end: failed"}
MARKER_ORDER = ("start (agent)", "goal", "path", NO_MOVE, *END_LABELS.values())
"""Legend entries of an episode grid, in order (those that appear)."""


def _maze_legend(fig: Any, axes: list[Any]) -> None:
    """One figure legend under the grid: the maze's start and goal colours and every marker
    type drawn on any of `axes`."""
    from matplotlib.lines import Line2D

    handles = {"start (agent)": Line2D([], [], ls="", marker="o", color=PALETTE["start"]),
               "goal": Line2D([], [], ls="", marker="s", color=PALETTE["goal"])}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    labels = [label for label in MARKER_ORDER if label in handles]
    fig.legend([handles[label] for label in labels], labels, loc="outside lower center",
               ncols=3, fontsize=8, frameon=False)


def grid_figure(episodes: Sequence[EpisodeLike], titles: list[str] | None = None, cols: int = 4,
                panel_in: float = 3.0, pyplot: bool = True,
                config: MazeConfig | None = None) -> Any:
    """A figure of episodes on their mazes, `cols` per row, with one legend of the markers.
    pyplot=False makes a bare matplotlib Figure (not shown by a notebook; for static PNGs)."""
    cols = max(1, min(cols, len(episodes)))
    rows = max(1, (len(episodes) + cols - 1) // cols)
    size = (panel_in * cols, (panel_in + 0.45) * rows + 0.5)
    if pyplot:
        fig = require("matplotlib.pyplot").figure(figsize=size, layout="constrained")
    else:
        fig = require("matplotlib.figure").Figure(figsize=size, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flat
    for k, ax in enumerate(axes):
        if k < len(episodes):
            draw_episode(ax, episodes[k], config)
            if titles:
                ax.set_title(f"{titles[k]}\n{ax.get_title()}", fontsize=9)
        else:
            ax.axis("off")
    _maze_legend(fig, list(fig.axes))
    return fig


def episode_grid(episodes: Sequence[EpisodeLike], config: MazeConfig,
                 titles: list[str] | None = None, cols: int = 4) -> Any:
    """A figure of episodes drawn on their mazes, `cols` per row, with a legend of the start,
    goal and every marker type shown (image axes: no ticks, the maze is the picture)."""
    return grid_figure(episodes, titles, cols, config=config)


def figure_png(fig: Any, dpi: int = 80) -> bytes:
    """A Figure as PNG bytes, at its own size (figsize x dpi pixels)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
