"""Pictures of mazes and episodes (matplotlib, the `viz` extra). Reads records, never a trainer.

    fig = episode_grid(episodes, MazeConfig(size=7)); fig.savefig("episodes.png")
"""

from __future__ import annotations

from typing import Any

from workbench._deps import require
from workbench.envs import MazeConfig, init_maze, render_image
from workbench.rl.rollout import Episode


def _centre(pos: tuple[int, int], px: int) -> tuple[float, float]:
    return (pos[1] + 0.5) * px, (pos[0] + 0.5) * px


def draw_episode(ax: Any, episode: Episode, config: MazeConfig) -> None:
    """The maze with the agent at its start, the path taken, bumps/invalid turns and the end."""
    px = config.px_per_cell
    maze = init_maze(episode.init_state)
    ax.imshow(render_image(maze, maze.start, px))
    xs, ys = zip(*(_centre(p, px) for p in episode.positions))
    ax.plot(xs, ys, "-", color="orange", lw=2, alpha=0.8)
    stuck = [episode.positions[t + 1] for t, a in enumerate(episode.actions)
             if a.kind == "invalid" or episode.positions[t + 1] == episode.positions[t]]
    if stuck:
        sx, sy = zip(*(_centre(p, px) for p in stuck))
        ax.plot(sx, sy, "x", color="black", ms=8, mew=2, label="no move")
    ex, ey = _centre(episode.positions[-1], px)
    ax.plot([ex], [ey], "o", mfc="none", mec="lime" if episode.success else "magenta", ms=14, mew=3)
    verdict = "solved" if episode.success else "failed"
    ax.set_title(f"seed {episode.init_state.maze_seed}: {verdict} in {episode.turns}", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def episode_grid(episodes: list[Episode], config: MazeConfig, titles: list[str] | None = None,
                 cols: int = 4) -> Any:
    """A figure of episodes drawn on their mazes, `cols` per row."""
    plt = require("matplotlib.pyplot")
    rows = (len(episodes) + cols - 1) // cols
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


def plot_training(rows: list[dict], title: str = "GRPO") -> Any:
    """Reward and success per step (rollouts), eval success with the oracle ceiling as a line."""
    plt = require("matplotlib.pyplot")
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax1.plot([r["step"] for r in steps], [r["reward/mean"] for r in steps], label="reward mean")
    ax1.plot([r["step"] for r in steps], [r["rollout/success_rate"] for r in steps],
             label="rollout success")
    ax1.plot([r["step"] for r in steps], [r["rollout/zero_variance_frac"] for r in steps],
             ":", label="zero-variance groups")
    ax1.set_xlabel("step")
    ax1.set_title(f"{title}: training rollouts")
    ax1.legend(fontsize=8)
    for mode, style in (("greedy", "o-"), ("sampled", "s-")):
        pts = [(r["step"], r[f"eval/{mode}_solved"]) for r in evals if f"eval/{mode}_solved" in r]
        if pts:
            ax2.plot(*zip(*pts), style, label=f"eval {mode}")
    if evals:
        ax2.axhline(evals[-1]["eval/ceiling"], color="gray", ls="--", label="oracle ceiling")
        ax2.set_ylim(0, evals[-1]["eval/n_mazes"] + 1)
    ax2.set_xlabel("step")
    ax2.set_ylabel("mazes solved")
    ax2.set_title("fixed eval set")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig
