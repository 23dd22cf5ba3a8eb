"""Episodes as pictures and per-turn rows: drawn on their mazes, or frame by frame.

Every function takes an `Episode` or its summary dict (`workbench.run.episode_summary`, what a
step record's episodes.json holds), so the same pictures serve a live rollout and a run folder.

    fig = episode_grid(episodes, MazeConfig(size=7)); fig.savefig("episodes.png")
    turn_rows(episode)[0]   # {"turn": 1, "reply": "up", "action": "move up", ...}
"""

from __future__ import annotations

import io
from typing import Any

from workbench.deps import require
from workbench.envs import DIRECTIONS, InitState, MazeConfig, init_maze, render_image
from workbench.rl.rollout import Episode

EpisodeLike = Episode | dict[str, Any]


def as_record(episode: EpisodeLike) -> dict[str, Any]:
    """The episode's summary dict (an Episode is summarised; a dict is returned as it is)."""
    if isinstance(episode, dict):
        return episode
    from workbench.run import episode_summary

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
    pil = require("PIL.Image")
    rec = as_record(episode)
    maze = init_maze(InitState.from_dict(rec["init_state"]))
    pos = tuple(rec["positions"][turn - 1])
    buf = io.BytesIO()
    pil.fromarray(render_image(maze, pos, px_per_cell)).save(buf, format="PNG")
    return buf.getvalue()


def _centre(pos: tuple[int, int], px: int) -> tuple[float, float]:
    return (pos[1] + 0.5) * px, (pos[0] + 0.5) * px


def draw_episode(ax: Any, episode: EpisodeLike, config: MazeConfig) -> None:
    """The maze with the agent at its start, the path taken, bumps/invalid turns and the end."""
    rec, px = as_record(episode), config.px_per_cell
    state = InitState.from_dict(rec["init_state"])
    maze = init_maze(state)
    positions = [tuple(p) for p in rec["positions"]]
    ax.imshow(render_image(maze, maze.start, px))
    xs, ys = zip(*(_centre(p, px) for p in positions))
    ax.plot(xs, ys, "-", color="orange", lw=2, alpha=0.8)
    stuck = [positions[t + 1] for t, a in enumerate(rec["actions"])
             if a == "invalid" or positions[t + 1] == positions[t]]
    if stuck:
        sx, sy = zip(*(_centre(p, px) for p in stuck))
        ax.plot(sx, sy, "x", color="black", ms=8, mew=2, label="no move")
    ex, ey = _centre(positions[-1], px)
    ax.plot([ex], [ey], "o", mfc="none", mec="lime" if rec["success"] else "magenta", ms=14,
            mew=3)
    verdict = "solved" if rec["success"] else "failed"
    ax.set_title(f"seed {state.maze_seed}: {verdict} in {rec['turns']}", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def episode_grid(episodes: list[EpisodeLike], config: MazeConfig,
                 titles: list[str] | None = None, cols: int = 4) -> Any:
    """A figure of episodes drawn on their mazes, `cols` per row."""
    plt = require("matplotlib.pyplot")
    cols = max(1, min(cols, len(episodes)))
    rows = max(1, (len(episodes) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3.2 * rows), squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k < len(episodes):
            draw_episode(ax, episodes[k], config)
            if titles:
                ax.set_title(f"{titles[k]}\n{ax.get_title()}", fontsize=9)
        else:
            ax.axis("off")
    fig.tight_layout()
    return fig
