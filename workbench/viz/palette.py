"""One palette for every picture the workbench draws, so a quantity keeps its colour across plots
and notebooks (Okabe-Ito colours, readable by colour-blind readers; the maze's own start and
goal colours come from the renderer).

    ax.plot(steps, rewards, color=PALETTE["reward"])
    ax.plot(steps, solved, color=PALETTE["grpo"], label="grpo")
"""

from __future__ import annotations

from workbench.envs.maze import AGENT_RGB, GOAL_RGB


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


BLUE, SKY, GREEN, ORANGE = "#0072B2", "#56B4E9", "#009E73", "#E69F00"
VERMILLION, PURPLE, BLACK, GREY = "#D55E00", "#CC79A7", "#000000", "#7f7f7f"

PALETTE: dict[str, str] = {
    # policies (one colour per policy wherever policies are compared)
    "policy": BLUE, "grpo": BLUE, "sft": SKY, "oracle": GREEN, "random": GREY,
    # training rollouts and behaviour (plot_training)
    "reward": BLUE, "success": GREEN, "turns": GREY, "entropy": BLACK,
    "wall_bump": VERMILLION, "invalid": PURPLE, "loop": ORANGE, "zero_variance": SKY,
    # the update (plot_training)
    "loss": BLUE, "grad_norm": GREEN, "kl": PURPLE, "no_update": GREY,
    # evaluation modes (plot_training's eval panel)
    "greedy": BLUE, "sampled": ORANGE, "ceiling": GREY,
    # advantages (plot_advantages)
    "advantage_pos": GREEN, "advantage_neg": VERMILLION, "advantage_zero": GREY,
    # episodes drawn on their mazes (episode_grid, the viewers' static pictures)
    "start": _hex(AGENT_RGB), "goal": _hex(GOAL_RGB), "path": ORANGE, "stuck": BLACK,
    "end_solved": GREEN, "end_failed": "#FF00FF",
    # time per phase (plot_phase_times)
    "rollout": SKY, "update": BLUE, "weight_sync": ORANGE, "other": "#d3d3d3",
    # log-probabilities (plot_logprob_scatter)
    "tokens": BLUE, "diagonal": GREY,
    # the context budget (plot_context_budget)
    "image": ORANGE, "text": SKY, "reply": BLUE, "limit": VERMILLION,
}
"""Named colours (matplotlib colour strings); keys name what is drawn, not where."""

HEATMAP = "viridis"
"""Colour map of heatmaps (plot_grad_norms)."""
