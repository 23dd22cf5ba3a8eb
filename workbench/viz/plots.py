"""matplotlib figures of training records: metrics.jsonl rows, advantages, log-probabilities,
gradient norms. Every axes has both axis labels (image axes aside) and every series or marker
type a legend entry; colours come from `workbench.viz.palette.PALETTE`.

    rows = read_metrics("runs/grpo")
    plot_training(rows); plot_phase_times(rows)
    plot_advantages(adv.advantages_P_G, sc.rewards_P_G)
    plot_logprob_scatter(sampler_N, trainer_N)
    plot_grad_norms(module_grad_norms(...))    # heatmap: layers x module types
    plot_context_budget(turn_budget(episode, limit), limit)   # tokens per turn, the limit

Each function returns the Figure (a notebook shows it; a script calls fig.savefig). A key a
row does not hold (a step without an update logs no loss) is a gap in its line, never a zero.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from workbench.deps import require
from workbench.viz.palette import HEATMAP, PALETTE

PHASES = ("time/rollout", "time/update", "time/weight_sync")

Series = tuple[tuple[str, str, str, str], ...]
"""(metrics.jsonl key, legend label, PALETTE colour name, line style) per line of a panel."""

ROLLOUTS: Series = (("reward/mean", "reward mean", "reward", "-"),
                    ("rollout/success_rate", "success rate", "success", "--"))
TURNS: Series = (("rollout/solved_turns_mean", "turns of solved episodes", "turns", ":"),)
BEHAVIOUR: Series = (("rollout/wall_bump_rate", "wall bumps / turn", "wall_bump", "-"),
                     ("rollout/invalid_rate", "invalid replies / turn", "invalid", "-"),
                     ("rollout/loop_rate", "revisits / turn", "loop", "-"),
                     ("rollout/zero_variance_frac", "zero-variance groups", "zero_variance", "-"))
"""Per-step fractions the behaviour panel of plot_training draws."""
ENTROPY: Series = (("rollout/entropy", "entropy (nats / turn)", "entropy", ":"),)
UPDATE: Series = (("update/loss", "loss", "loss", "-"),
                  ("update/grad_norm", "gradient norm (before clipping)", "grad_norm", "-"))
"""The update panel of plot_training (left axis; the sampler-trainer KL is on the right)."""
KL: Series = (("update/kl_sampler_trainer", "KL sampler vs trainer", "kl", ":"),)


def noise_band(solved: float, n_mazes: int, passes: int = 1, z: float = 1.96) -> float:
    """Half-width, in mazes solved, of the z-sigma binomial band of a success measured on
    n_mazes mazes x passes episodes (64 episodes at 50% carry about +-7.8 mazes at 95%)."""
    p = min(max(solved / n_mazes, 0.0), 1.0)
    return z * n_mazes * float(np.sqrt(p * (1 - p) / (n_mazes * passes)))


def plot_training(rows: list[dict], title: str = "GRPO", ceiling: float | None = None) -> Any:
    """Four panels over the steps of a run's metrics.jsonl rows: training rollouts (reward,
    success, mean turns of solved episodes), behaviour (wall-bump, invalid-reply and revisit
    rates, zero-variance groups, entropy per turn), the fixed eval set (greedy and sampled solved
    with a 95% binomial noise band, and the oracle ceiling; `ceiling` overrides the logged one)
    and the update (loss, gradient norm, sampler-trainer KL; steps without an update marked).
    Keys a run did not log are left out; keys a row did not log are gaps."""
    plt = require("matplotlib.pyplot")
    steps = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), layout="constrained")
    (ax1, ax2), (ax3, ax4) = axes
    _lines(ax1, steps, ROLLOUTS, ylabel="reward, success rate")
    _legend(ax1, _lines(ax1.twinx(), steps, TURNS, ylabel="turns"))
    ax1.set_title(f"{title}: training rollouts")
    _lines(ax2, steps, BEHAVIOUR, ylabel="fraction")
    _legend(ax2, _lines(ax2.twinx(), steps, ENTROPY, ylabel="entropy (nats / turn)"))
    ax2.set_title("behaviour per step")
    _eval_panel(ax3, evals, ceiling)
    _update_panel(ax4, steps)
    for ax in axes.flat:  # steps are whole numbers
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    return fig


def _lines(ax: Any, rows: list[dict], series: Series, ylabel: str = "") -> Any:
    """One line per series against the step; a row without the key is a gap (isolated points
    get a marker, so a value between two gaps still shows)."""
    x = np.array([r["step"] for r in rows], dtype=float)
    for key, label, colour, style in series:
        if not any(key in r for r in rows):
            continue
        y = np.array([r.get(key, np.nan) for r in rows], dtype=float)
        ax.plot(x, y, style, color=PALETTE[colour], label=label)
        known = ~np.isnan(y)
        isolated = known & ~np.r_[False, known[:-1]] & ~np.r_[known[1:], False]
        if isolated.any():
            ax.plot(x[isolated], y[isolated], "o", ms=3, color=PALETTE[colour], label="_gap")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    return ax


def _legend(ax: Any, *others: Any, extra: tuple = ()) -> None:
    """One legend under `ax` (never over the data) for its lines, those of `others` (twin axes)
    and `extra` (handle, label) pairs."""
    handles, labels = ax.get_legend_handles_labels()
    for other in others:
        h, lab = other.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    for handle, label in extra:
        handles, labels = handles + [handle], labels + [label]
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14),
                  ncols=3, frameon=False)


def _eval_panel(ax: Any, evals: list[dict], ceiling: float | None) -> None:
    from matplotlib.patches import Patch

    for mode, style in (("greedy", "o-"), ("sampled", "s-")):
        pts = [(r["step"], r[f"eval/{mode}_solved"], r.get(f"eval/{mode}_passes", 1))
               for r in evals if f"eval/{mode}_solved" in r]
        if not pts:
            continue
        x, y, passes = (np.array(v, dtype=float) for v in zip(*pts))
        n = evals[-1]["eval/n_mazes"]
        band = np.array([noise_band(s, n, int(k)) for s, k in zip(y, passes)])
        ax.plot(x, y, style, color=PALETTE[mode], label=f"eval {mode}")
        ax.fill_between(x, y - band, y + band, color=PALETTE[mode], alpha=0.15,
                        label="_band")  # one legend entry for both bands, below
    if ceiling is None and evals:
        ceiling = evals[-1]["eval/ceiling"]
    if ceiling is not None:
        ax.axhline(ceiling, color=PALETTE["ceiling"], ls="--", label="oracle ceiling")
    if evals:
        ax.set_ylim(0, evals[-1]["eval/n_mazes"] + 1)
    ax.set_xlabel("step")
    ax.set_ylabel("mazes solved")
    ax.set_title("held-out eval set")
    noise = Patch(color=PALETTE["ceiling"], alpha=0.3)
    _legend(ax, extra=((noise, "95% binomial noise band"),) if ax.collections else ())


def _update_panel(ax: Any, steps: list[dict]) -> None:
    """Loss and gradient norm (left), sampler-trainer KL (right, log scale when positive); a
    step that made no update (every group had zero reward variance) is shaded."""
    twin = _lines(ax.twinx(), steps, KL, ylabel="KL sampler vs trainer")
    if any(r.get("update/kl_sampler_trainer", 0) > 0 for r in steps):
        twin.set_yscale("log")
    _lines(ax, steps, UPDATE, ylabel="loss, gradient norm")
    skipped = [r["step"] for r in steps if "update/loss" not in r]
    if any("update/loss" in r for r in steps):
        for k, step in enumerate(skipped):
            ax.axvspan(step - 0.5, step + 0.5, color=PALETTE["no_update"], alpha=0.25, lw=0,
                       label="no update (zero-variance batch)" if k == 0 else "_skipped")
    _legend(ax, twin)
    ax.set_title("update per step")


def plot_advantages(advantages_P_G: np.ndarray, rewards_P_G: np.ndarray | None = None,
                    cols: int = 4) -> Any:
    """One small histogram per group (maze) of its G advantages, positive, negative and zero
    stacked in their colours; a flat (zero-variance) group is named in its title."""
    plt = require("matplotlib.pyplot")
    adv_P_G = np.asarray(advantages_P_G, dtype=float)
    P = adv_P_G.shape[0]
    cols = max(1, min(cols, P))
    rows = (P + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(2.9 * cols, 2.3 * rows + 0.5), squeeze=False,
                             layout="constrained")
    bound = max(1.0, float(np.abs(adv_P_G).max()) if adv_P_G.size else 1.0)
    bins = np.linspace(-bound, bound, 14)  # 13 bins: zero sits in the middle one
    kinds = (("advantage_neg", "advantage < 0", np.less), ("advantage_zero", "advantage = 0",
             np.equal), ("advantage_pos", "advantage > 0", np.greater))
    for p, ax in enumerate(axes.flat):
        if p >= P:
            ax.axis("off")  # an empty slot of the grid
            continue
        parts = [(adv_P_G[p][test(adv_P_G[p], 0.0)], PALETTE[c], label)
                 for c, label, test in kinds if test(adv_P_G[p], 0.0).any()]
        ax.hist([v for v, _, _ in parts], bins=bins, stacked=True,
                color=[c for _, c, _ in parts], label=[lab for _, _, lab in parts])
        flat = bool(np.all(adv_P_G[p] == 0.0))
        label = f"maze {p}" + (" (zero variance)" if flat else "")
        if rewards_P_G is not None:
            label += "\nrewards " + " ".join(f"{r:.2g}" for r in np.asarray(rewards_P_G[p]))
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("advantage", fontsize=8)
        ax.set_ylabel("samples", fontsize=8)
    handles = {lab: h for ax in fig.axes for h, lab in zip(*ax.get_legend_handles_labels())}
    order = [label for _, label, _ in kinds if label in handles]
    fig.legend([handles[k] for k in order], order, loc="outside lower center", ncols=3,
               fontsize=8, frameon=False)
    fig.suptitle("advantages per group", fontsize=10)
    return fig


def plot_logprob_scatter(sampler_N: np.ndarray, trainer_N: np.ndarray) -> Any:
    """Sampler vs trainer log-probability of every reply token, with the diagonal."""
    plt = require("matplotlib.pyplot")
    s_N, t_N = np.asarray(sampler_N, dtype=float), np.asarray(trainer_N, dtype=float)
    fig, ax = plt.subplots(figsize=(4.2, 4), layout="constrained")
    ax.scatter(s_N, t_N, s=10, alpha=0.6, color=PALETTE["tokens"], label="reply token")
    lo = float(min(s_N.min(), t_N.min())) if s_N.size else -1.0
    ax.plot([lo, 0], [lo, 0], "--", color=PALETTE["diagonal"], lw=1, label="equal (y = x)")
    gap = float(np.abs(s_N - t_N).max()) if s_N.size else 0.0
    ax.set_xlabel("sampler log-prob")
    ax.set_ylabel("trainer log-prob")
    ax.set_title(f"{s_N.size} reply tokens, max |diff| {gap:.1e}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def plot_phase_times(rows: list[dict]) -> Any:
    """Stacked bars per step: rollout, update, weight sync and the rest of the step (seconds)."""
    plt = require("matplotlib.pyplot")
    steps = [r for r in rows if "time/step" in r]
    x = [r["step"] for r in steps]
    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    bottom = np.zeros(len(steps))
    for key in PHASES:
        name = key.removeprefix("time/")
        values = np.array([r.get(key, 0.0) for r in steps])
        ax.bar(x, values, bottom=bottom, label=name.replace("_", " "), color=PALETTE[name])
        bottom += values
    rest = np.array([r["time/step"] for r in steps]) - bottom
    ax.bar(x, np.clip(rest, 0, None), bottom=bottom, label="other", color=PALETTE["other"])
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("time per phase", fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig


def plot_context_budget(rows: list[dict], limit: int) -> Any:
    """Stacked bars per turn of `rl.budget.turn_budget` rows: the context held before the turn,
    then the turn's image, text and reply tokens, under a line at the engine's limit."""
    plt = require("matplotlib.pyplot")
    x = [r["turn"] for r in rows]
    parts = {key: np.array([r[key] for r in rows]) for key in
             ("image_tokens", "text_tokens", "reply_tokens")}
    bottom = np.clip(np.array([r["context"] for r in rows]) - sum(parts.values()), 0, None)
    fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
    ax.bar(x, bottom, label="earlier turns", color=PALETTE["other"])
    for key, colour in zip(parts, ("image", "text", "reply")):
        ax.bar(x, parts[key], bottom=bottom, label=key.replace("_", " "), color=PALETTE[colour])
        bottom = bottom + parts[key]
    ax.axhline(limit, color=PALETTE["limit"], linestyle="--", label=f"limit ({limit})")
    ax.set_xlabel("turn (0: system prompt)")
    ax.set_ylabel("tokens")
    ax.set_title("context per turn", fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig


LAYERED = re.compile(r"^(?P<stack>(?:.+\.)?(?:layers|blocks|deepstack_merger_list))"
                     r"\.(?P<index>\d+)\.(?P<kind>.+)$")
"""A module inside a stack of layers: "layers.3.self_attn.q_proj", "visual.blocks.0.attn.qkv"."""
KIND_ORDER = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "proj", "linear_fc1", "linear_fc2")
"""Column order of module types: attention, then MLP (language model, then vision tower)."""
STACK_NAMES = {"layers": "layer", "visual.blocks": "vision block",
               "visual.deepstack_merger_list": "deepstack merger"}


def module_kind(kind: str) -> str:
    """A module's short type: "self_attn.q_proj" -> "q", "mlp.down_proj" -> "down",
    "attn.qkv" -> "qkv", "mlp.linear_fc1" -> "linear_fc1"."""
    return re.sub(r"^(self_attn|attn|mlp)\.", "", kind).removesuffix("_proj")


def group_by_layer(norms: dict[str, float]) -> tuple[dict[str, Any], dict[str, float]]:
    """Module values as one grid per stack of layers - {stack: (row labels, column labels,
    values_LK with NaN where a layer lacks a type)} - and the modules outside any stack."""
    cells: dict[str, dict[tuple[int, str], float]] = {}
    others: dict[str, float] = {}
    for name, value in norms.items():
        m = LAYERED.match(name)
        if m:
            cells.setdefault(m["stack"], {})[(int(m["index"]), module_kind(m["kind"]))] = value
        else:
            others[name] = value
    grids = {}
    for stack, values in cells.items():
        layers = sorted({i for i, _ in values})
        kinds = sorted({k for _, k in values},
                       key=lambda k: (KIND_ORDER.index(k) if k in KIND_ORDER else 99, k))
        values_LK = np.array([[values.get((i, k), np.nan) for k in kinds] for i in layers])
        name = STACK_NAMES.get(stack, stack)
        grids[stack] = ([f"{name} {i}" for i in layers], kinds, values_LK)
    return grids, others


def plot_grad_norms(norms: dict[str, float]) -> Any:
    """Gradient norm per trainable module (rl.inspect.module_grad_norms), grouped by layer: a
    heatmap of layers x module types (q, k, v, o, gate, up, down) per stack of layers, one colour
    scale and colourbar, values written in the cells when they fit; modules outside a stack of
    layers as horizontal bars below."""
    plt = require("matplotlib.pyplot")
    if not norms:
        raise ValueError("no gradient norms to plot (no trainable module had a gradient)")
    grids, others = group_by_layer(norms)
    heights = [0.32 * len(rows) + 1.0 for rows, _, _ in grids.values()]
    heights += [0.3 * len(others) + 1.0] if others else []
    fig, axes = plt.subplots(len(heights), 1, figsize=(6.5, sum(heights)), squeeze=False,
                             height_ratios=heights, layout="constrained")
    axes = list(axes[:, 0])
    top = max(norms.values(), default=1.0) or 1.0
    images = [_heatmap(ax, grid, top) for ax, grid in zip(axes, grids.values())]
    if images:
        bar = fig.colorbar(images[0], ax=axes[:len(images)], shrink=0.9)
        bar.set_label("gradient norm (before clipping)", fontsize=9)
    if others:
        ax = axes[-1]
        names = list(others)
        ax.barh(range(len(names)), [others[n] for n in names], color=PALETTE["grad_norm"],
                label="module outside a layer stack")
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("gradient norm (before clipping)")
        ax.set_ylabel("module")
        ax.legend(fontsize=8)
    fig.suptitle("gradient norm per module, before clipping", fontsize=10)
    return fig


def _heatmap(ax: Any, grid: tuple[list[str], list[str], np.ndarray], top: float) -> Any:
    rows, kinds, values_LK = grid
    cmap = require("matplotlib").colormaps[HEATMAP].with_extremes(bad="lightgray")
    image = ax.imshow(np.ma.masked_invalid(values_LK), cmap=cmap, vmin=0.0, vmax=top,
                      aspect="auto")
    ax.set_xticks(range(len(kinds)), kinds, fontsize=9)
    ax.set_yticks(range(len(rows)), rows, fontsize=9)
    ax.set_xlabel("module type", fontsize=9)
    ax.set_ylabel(rows[0].rsplit(" ", 1)[0], fontsize=9)
    if values_LK.size <= 120:
        for (i, k), v in np.ndenumerate(values_LK):
            if not np.isnan(v):
                ax.text(k, i, f"{v:.2g}", ha="center", va="center", fontsize=7,
                        color="white" if v < 0.6 * top else "black")
    return image
