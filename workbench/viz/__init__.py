"""Pictures and viewers of records (matplotlib and ipywidgets; the `viz` / `notebook` extras).

Everything here reads records - Episodes, episode summaries from a step record, metrics.jsonl
rows, a run directory - and never a live trainer, so it works on finished and running runs.
Colours come from one palette (`PALETTE`), so a quantity looks the same in every notebook.

    fig = plot_training(read_metrics("runs/grpo"))          # rollouts, behaviour, eval, update
    trajectory_player(episode)                               # a widget: slider over turns
    step_inspector("runs/grpo")                              # pick a step, see it, replay it

A viewer displays a static picture (`viewer.png()`) above its live widget, so a saved notebook
and its HTML keep the trajectories; where the widget cannot be drawn, the line under the picture
is `viewer.summary()`, not the widget's repr. matplotlib and ipywidgets are imported when needed.
"""

from workbench.viz.episodes import (
    as_record,
    draw_episode,
    episode_grid,
    episode_strip,
    episode_strip_png,
    figure_png,
    frame_png,
    turn_rows,
)
from workbench.viz.palette import PALETTE
from workbench.viz.plots import (
    group_by_layer,
    noise_band,
    plot_advantages,
    plot_context_budget,
    plot_grad_norms,
    plot_logprob_scatter,
    plot_phase_times,
    plot_training,
)
from workbench.viz.widgets import (
    GroupView,
    Player,
    StepInspector,
    TokenView,
    group_view,
    step_inspector,
    token_view,
    trajectory_player,
)

__all__ = [
    "PALETTE", "GroupView", "Player", "StepInspector", "as_record", "draw_episode",
    "episode_grid", "episode_strip", "episode_strip_png", "figure_png", "frame_png",
    "group_by_layer", "group_view", "noise_band", "plot_advantages", "plot_grad_norms",
    "plot_context_budget", "plot_logprob_scatter", "plot_phase_times", "plot_training",
    "step_inspector", "TokenView", "token_view", "trajectory_player", "turn_rows",
]
