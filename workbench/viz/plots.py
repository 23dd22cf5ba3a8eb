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

from workbench._deps import require

PHASES = ("time/rollout", "time/update", "time/weight_sync")


def plot_training(rows: list[dict], title: str = "GRPO", ceiling: float | None = None) -> Any:
    """Reward and success per step (rollouts), eval success with the oracle ceiling as a line
    (`ceiling` overrides the one logged with the evaluations)."""
    plt = require("matplotlib.pyplot")
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for key, style, label in (("reward/mean", "-", "reward mean"),
                              ("rollout/success_rate", "-", "rollout success"),
                              ("rollout/zero_variance_frac", ":", "zero-variance groups")):
        ax1.plot([r["step"] for r in steps], [r[key] for r in steps], style, label=label)
    ax1.set_xlabel("step")
    ax1.set_title(f"{title}: training rollouts")
    ax1.legend(fontsize=8)
    for mode, style in (("greedy", "o-"), ("sampled", "s-")):
        pts = [(r["step"], r[f"eval/{mode}_solved"]) for r in evals if f"eval/{mode}_solved" in r]
        if pts:
            ax2.plot(*zip(*pts), style, label=f"eval {mode}")
    if ceiling is None and evals:
        ceiling = evals[-1]["eval/ceiling"]
    if ceiling is not None:
        ax2.axhline(ceiling, color="gray", ls="--", label="oracle ceiling")
    if evals:
        ax2.set_ylim(0, evals[-1]["eval/n_mazes"] + 1)
    ax2.set_xlabel("step")
    ax2.set_ylabel("mazes solved")
    ax2.set_title("fixed eval set")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


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
