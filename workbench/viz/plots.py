"""matplotlib figures of training records: metrics.jsonl rows, advantages, log-probabilities.

    rows = read_metrics("runs/grpo")
    plot_training(rows); plot_phase_times(rows)
    plot_advantages(adv.advantages_P_G, sc.rewards_P_G)
    plot_logprob_scatter(sampler_N, trainer_N)

Each function returns the Figure (a notebook shows it; a script calls fig.savefig).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from workbench.deps import require

PHASES = ("time/rollout", "time/update", "time/weight_sync")


BEHAVIOUR = (("rollout/wall_bump_rate", "wall bumps / turn"),
             ("rollout/invalid_rate", "invalid replies / turn"),
             ("rollout/zero_variance_frac", "zero-variance groups"))
"""Per-step fractions the middle panel of plot_training draws (metrics.jsonl keys)."""


def noise_band(solved: float, n_mazes: int, passes: int = 1, z: float = 1.96) -> float:
    """Half-width, in mazes solved, of the z-sigma binomial band of a success measured on
    n_mazes mazes x passes episodes (64 episodes at 50% carry about +-7.8 mazes at 95%)."""
    p = min(max(solved / n_mazes, 0.0), 1.0)
    return z * n_mazes * float(np.sqrt(p * (1 - p) / (n_mazes * passes)))


def plot_training(rows: list[dict], title: str = "GRPO", ceiling: float | None = None) -> Any:
    """Three panels over the steps of a run's metrics.jsonl rows: training rollouts (reward,
    success, mean turns of solved episodes), behaviour (wall-bump and invalid-reply rates,
    zero-variance groups, entropy per turn) and the fixed eval set (greedy and sampled solved
    with a 95% binomial noise band, and the oracle ceiling; `ceiling` overrides the logged one).
    Keys a run did not log are left out."""
    plt = require("matplotlib.pyplot")
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 3.8))
    _lines(ax1, steps, (("reward/mean", "reward mean"), ("rollout/success_rate", "success")))
    _lines(ax1.twinx(), steps, (("rollout/solved_turns_mean", "turns of solved episodes"),),
           style=":", color="tab:gray", ylabel="turns")
    ax1.set_title(f"{title}: training rollouts")
    _lines(ax2, steps, BEHAVIOUR)
    _lines(ax2.twinx(), steps, (("rollout/entropy", "entropy (nats / turn)"),),
           style=":", color="tab:purple", ylabel="nats per turn")
    ax2.set_title("behaviour per step")
    _eval_panel(ax3, evals, ceiling)
    fig.tight_layout()
    return fig


def _lines(ax: Any, rows: list[dict], keys: tuple[tuple[str, str], ...], style: str = "-",
           color: str | None = None, ylabel: str = "") -> None:
    """One line per (key, label) present in the rows, against the step, with a legend."""
    for key, label in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), style, label=label, color=color)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right" if ylabel else "upper left")


def _eval_panel(ax: Any, evals: list[dict], ceiling: float | None) -> None:
    for mode, style in (("greedy", "o-"), ("sampled", "s-")):
        pts = [(r["step"], r[f"eval/{mode}_solved"], r.get(f"eval/{mode}_passes", 1))
               for r in evals if f"eval/{mode}_solved" in r]
        if not pts:
            continue
        x, y, passes = (np.array(v, dtype=float) for v in zip(*pts))
        n = evals[-1]["eval/n_mazes"]
        band = np.array([noise_band(s, n, int(k)) for s, k in zip(y, passes)])
        line, = ax.plot(x, y, style, label=f"eval {mode}")
        ax.fill_between(x, y - band, y + band, color=line.get_color(), alpha=0.15)
    if ceiling is None and evals:
        ceiling = evals[-1]["eval/ceiling"]
    if ceiling is not None:
        ax.axhline(ceiling, color="gray", ls="--", label="oracle ceiling")
    if evals:
        ax.set_ylim(0, evals[-1]["eval/n_mazes"] + 1)
    ax.set_xlabel("step")
    ax.set_ylabel("mazes solved")
    ax.set_title("held-out eval set (band: 95% binomial noise)")
    ax.legend(fontsize=7, loc="lower right")


def plot_advantages(advantages_P_G: np.ndarray, rewards_P_G: np.ndarray | None = None,
                    cols: int = 4) -> Any:
    """One small histogram per group (maze) of its G advantages; a flat group is marked."""
    plt = require("matplotlib.pyplot")
    adv_P_G = np.asarray(advantages_P_G, dtype=float)
    P = adv_P_G.shape[0]
    cols = max(1, min(cols, P))
    rows = (P + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(2.8 * cols, 2.2 * rows), squeeze=False)
    bound = max(1.0, float(np.abs(adv_P_G).max()) if adv_P_G.size else 1.0)
    for p, ax in enumerate(axes.flat):
        if p >= P:
            ax.axis("off")
            continue
        ax.hist(adv_P_G[p], bins=np.linspace(-bound, bound, 13), color="tab:blue")
        flat = bool(np.all(adv_P_G[p] == 0.0))
        label = f"maze {p}" + (" (zero variance)" if flat else "")
        if rewards_P_G is not None:
            label += f"\nrewards {np.round(np.asarray(rewards_P_G[p]), 2).tolist()}"
        ax.set_title(label, fontsize=8)
    fig.suptitle("advantages per group", fontsize=10)
    fig.tight_layout()
    return fig


def plot_logprob_scatter(sampler_N: np.ndarray, trainer_N: np.ndarray) -> Any:
    """Sampler vs trainer log-probability of every reply token, with the diagonal."""
    plt = require("matplotlib.pyplot")
    s_N, t_N = np.asarray(sampler_N, dtype=float), np.asarray(trainer_N, dtype=float)
    fig, ax = plt.subplots(figsize=(4.2, 4))
    ax.scatter(s_N, t_N, s=10, alpha=0.6)
    lo = float(min(s_N.min(), t_N.min())) if s_N.size else -1.0
    ax.plot([lo, 0], [lo, 0], "--", color="gray", lw=1)
    gap = float(np.abs(s_N - t_N).max()) if s_N.size else 0.0
    ax.set_xlabel("sampler log-prob")
    ax.set_ylabel("trainer log-prob")
    ax.set_title(f"{s_N.size} reply tokens, max |diff| {gap:.1e}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_phase_times(rows: list[dict]) -> Any:
    """Stacked bars per step: rollout, update, weight sync and the rest of the step (seconds)."""
    plt = require("matplotlib.pyplot")
    steps = [r for r in rows if "time/step" in r]
    x = [r["step"] for r in steps]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bottom = np.zeros(len(steps))
    for key in PHASES:
        values = np.array([r.get(key, 0.0) for r in steps])
        ax.bar(x, values, bottom=bottom, label=key.removeprefix("time/"))
        bottom += values
    rest = np.array([r["time/step"] for r in steps]) - bottom
    ax.bar(x, np.clip(rest, 0, None), bottom=bottom, label="other", color="lightgray")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("time per phase", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_grad_norms(norms: dict[str, float]) -> Any:
    """Horizontal bars: gradient norm per trainable module (rl.inspect.module_grad_norms)."""
    plt = require("matplotlib.pyplot")
    names = list(norms)
    fig, ax = plt.subplots(figsize=(6, 0.18 * len(names) + 1.2))
    ax.barh(range(len(names)), [norms[n] for n in names], color="tab:green")
    ax.set_yticks(range(len(names)), names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("gradient norm")
    ax.set_title("per module, before clipping", fontsize=9)
    fig.tight_layout()
    return fig
