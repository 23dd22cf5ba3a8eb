"""Pictures and viewers of records (matplotlib and ipywidgets; the `viz` / `notebook` extras).

Everything here reads records - Episodes, episode summaries from a step record, metrics.jsonl
rows, a run directory - and never a live trainer, so it works on finished and running runs.

    fig = plot_training(read_metrics("runs/grpo"))          # rollouts, behaviour, eval + band
    trajectory_player(episode)                               # a widget: slider over turns
    step_inspector("runs/grpo")                              # pick a step, see it, replay it

matplotlib and ipywidgets are imported when a function needs them.
"""

from workbench.viz.episodes import (
    as_record,
    draw_episode,
    episode_grid,
    frame_png,
    turn_rows,
)
from workbench.viz.plots import (
    noise_band,
    plot_advantages,
    plot_grad_norms,
    plot_logprob_scatter,
    plot_phase_times,
    plot_training,
)
from workbench.viz.widgets import (
    GroupView,
    Player,
    StepInspector,
    group_view,
    step_inspector,
    trajectory_player,
)

__all__ = [
    "GroupView", "Player", "StepInspector", "as_record", "draw_episode", "episode_grid",
    "frame_png", "group_view", "noise_band", "plot_advantages", "plot_grad_norms",
    "plot_logprob_scatter", "plot_phase_times", "plot_training", "step_inspector",
    "trajectory_player", "turn_rows",
]
