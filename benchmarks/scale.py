"""CPU scaling of one GRPO step (issue 7, CPU parts of sections 2 and 3): the multi-turn cost as
the turn budget grows, and step time and memory as the group and the maze grow.

    python benchmarks/scale.py --out runs/bench/scale.json --plot docs/scale_cpu.png   # ~10 min
    OMP_NUM_THREADS=1 python benchmarks/scale.py --smoke --threads 1                   # < 1 min

A step is `grpo_step` below (bench.py's `_demo_step` times the same), per phase: weight sync,
rollout of P mazes x G episodes (tiny model, LoRA r32, 2-token replies at temperature 1),
datums with advantages +-1 by episode parity (the untrained model earns no reward; the update
does the same work as with real signal), one update (ppo, sequence_mean, mini-batches of 16, one
optim_step).

- turns: the demo shape (8 mazes x 8 samples, 7x7) at max_turns 5, 10, 15. The untrained model
  never solves a maze, so every episode plays its whole budget (checked: mean and min turns are
  printed). Fit: step = a + b * turns (b: the marginal cost of a turn), its residual, the exact
  quadratic through the three points (the share of its t^2 term at the longest budget), and the
  ratios t15/t5 (3 if proportional, 9 if quadratic) and (t15-t10)/(t10-t5) (1 if linear, 5/3 if
  quadratic).
- scale: G = 4, 8, 16 episodes per maze x easy (size 9: 4x4 junction cells) and hard (size 11:
  5x5), 8 mazes, 15 turns, 32 px a cell (one image token a cell: 81 / 121 image tokens a turn).

Each configuration runs in a fresh Python process (`--case JSON`), so its peak RSS
(getrusage ru_maxrss of that process: model, session, warm-up and timed steps) belongs to it
alone; the RSS high-water after the session is built is reported too, so the step's own share
is peak - base. One small warm-up step (1 maze x G, the case's size, 2 turns) takes the first
calls out of the timings: a full-shape warm-up step measured within 1% of the steps after it
(demo shape, 5 turns: 17.09 s, then 16.94 and 16.89 s), so a small one does the job for far less.
Timings are medians of `repeats` steps (1 repeat: that step).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

MAZE_SIZES: dict[str, int] = {"7x7": 7, "easy": 9, "hard": 11}
"""Named maze sizes counted with the outer wall (easy and hard are VisGym's)."""


@dataclass(frozen=True)
class Case:
    """One configuration, measured in its own process."""

    section: str
    """turns | scale (which table the row belongs to)."""
    mazes: int = 8
    """P: mazes per step."""
    group: int = 8
    """G: episodes per maze."""
    size: int = 7
    """Maze side incl. the outer wall (7 = tiny default, 9 = easy, 11 = hard)."""
    max_turns: int = 15
    """Turn budget per episode (generator.max_turns)."""
    repeats: int = 1
    """Timed steps after the warm-up step (median reported)."""
    threads: int = 2
    """torch CPU threads."""


@dataclass(frozen=True)
class StepTiming:
    """Seconds and sizes of one GRPO step."""

    sync_s: float
    rollout_s: float
    update_s: float
    step_s: float
    mean_turns: float
    min_turns: int
    tokens_per_episode: float  # whole stream: system + user text + image pads + replies
    image_tokens_per_episode: float
    reply_tokens_per_episode: float


def run_config(case: Case) -> Any:
    """The tiny preset with the case's mazes, group, size and turn budget."""
    from workbench.config import PRESETS

    c = PRESETS["tiny"]
    return replace(c, env=replace(c.env, size=case.size),
                   generator=replace(c.generator, max_turns=case.max_turns,
                                     n_samples_per_prompt=case.group),
                   trainer=replace(c.trainer, train_batch_size=case.mazes))


def grpo_step(tc: Any, config: Any, step: int) -> StepTiming:
    """One GRPO step of `config`'s shape, timed per phase: weight sync, rollout, one update with
    +-1 advantages by episode parity (the untrained tiny model earns no reward). bench.py's
    in-process vs Ray comparison times the same step."""
    from workbench.policy import SamplingParams
    from workbench.rl import phases
    from workbench.rl.schedule import step_mazes
    from workbench.session import AdamParams, LossConfig, datum_from_stream

    t0 = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client()
    t1 = time.perf_counter()
    ro = phases.rollout(sampler, phases.Batch(config.task, step_mazes(config, step),
                                              config.generator.n_samples_per_prompt,
                                              SamplingParams(max_tokens=2), seed=step))
    datums = [datum_from_stream(ep.stream, 1.0 if k % 2 else -1.0) for k, ep in enumerate(ro.flat)]
    up = phases.update(tc, datums, phases.UpdateSettings(
        "ppo", LossConfig(reduction="sequence_mean"), AdamParams(learning_rate=1e-4)))
    t2 = time.perf_counter()
    turns_E = [ep.turns for ep in ro.flat]
    streams_E = [ep.stream for ep in ro.flat]
    return StepTiming(sync_s=t1 - t0, rollout_s=ro.seconds, update_s=up.seconds, step_s=t2 - t0,
                      mean_turns=float(np.mean(turns_E)), min_turns=int(min(turns_E)),
                      tokens_per_episode=float(np.mean([len(s) for s in streams_E])),
                      image_tokens_per_episode=_mean_sum([s.mm_types_T for s in streams_E]),
                      reply_tokens_per_episode=_mean_sum([s.loss_mask_T for s in streams_E]))


def _mean_sum(masks_E: list[list[int]]) -> float:
    """Mean over episodes of a 0/1 side table's count."""
    return float(np.mean([sum(m) for m in masks_E]))


def maxrss_gb() -> float:
    """This process's RSS high-water mark so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def measure_case(case: Case) -> dict[str, Any]:
    """Warm-up step, then `repeats` timed steps in this process -> medians and memory."""
    import torch

    from workbench.session import SessionSpec, create_session

    torch.set_num_threads(case.threads)
    config = run_config(case)
    with tempfile.TemporaryDirectory(prefix="workbench-scale-") as tmp:
        session = create_session(SessionSpec("tiny", workdir=str(tmp)))
        base_gb = maxrss_gb()
        tc = session.training_client
        t0 = time.perf_counter()
        grpo_step(tc, run_config(replace(case, mazes=1, max_turns=2)), 1)  # warm-up
        warmup_s = time.perf_counter() - t0
        steps = [grpo_step(tc, config, k + 2) for k in range(case.repeats)]
        session.close()
    out: dict[str, Any] = asdict(case)
    for key in asdict(steps[0]):
        out[key] = statistics.median(getattr(s, key) for s in steps)
    out["min_turns"] = min(s.min_turns for s in steps)
    out["step_s_all"] = [s.step_s for s in steps]
    out |= {"warmup_s": warmup_s, "base_rss_gb": base_gb, "peak_rss_gb": maxrss_gb()}
    return out


def measure_in_subprocess(case: Case) -> dict[str, Any]:
    """measure_case in a fresh interpreter (its own ru_maxrss); the result is its last line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", json.dumps(asdict(case))]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fit_linear(x: list[float], y: list[float]) -> dict[str, float]:
    """y = a + b x by least squares, its largest residual (fraction of y), the marginal cost
    between neighbouring points, the quadratic through the points (deg 2, exact for 3) with its
    t^2 term's share at the largest x, and the ratios last/first and of the increments."""
    x_N, y_N = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    b, a = np.polyfit(x_N, y_N, 1)
    resid_N = y_N - (a + b * x_N)
    out = {"a": float(a), "b": float(b),
           "max_residual_frac": float(np.max(np.abs(resid_N) / y_N)),
           "ratio_last_first": float(y_N[-1] / y_N[0]),
           "ratio_x": float(x_N[-1] / x_N[0]),
           "marginal": [float(v) for v in np.diff(y_N) / np.diff(x_N)]}
    if len(x_N) >= 3:
        c2 = np.polyfit(x_N, y_N, 2)[0]
        out["quad_c"] = float(c2)
        out["quad_share_at_last"] = float(c2 * x_N[-1] ** 2 / y_N[-1])
        out["increment_ratio"] = float((y_N[-1] - y_N[-2]) / (y_N[-2] - y_N[-3]))
    return out


def turns_analysis(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """fit_linear of step, rollout, update seconds and tokens per episode against max_turns."""
    turns = [r["max_turns"] for r in rows]
    keys = ("step_s", "rollout_s", "update_s", "tokens_per_episode")
    return {k: fit_linear(turns, [r[k] for r in rows]) for k in keys}


@dataclass(frozen=True)
class Plan:
    """What to measure: the turns sweep and the scale grid."""

    turns: tuple[int, ...] = (5, 10, 15)
    """max_turns of the turns sweep (demo shape, 7x7)."""
    turns_shape: tuple[int, int] = (8, 8)
    """(mazes, group) of the turns sweep."""
    groups: tuple[int, ...] = (4, 8, 16)
    """G of the scale grid."""
    sizes: tuple[str, ...] = ("easy", "hard")
    """Maze sizes of the scale grid (keys of MAZE_SIZES)."""
    scale_mazes: int = 8
    """P of the scale grid."""
    scale_turns: int = 15
    """max_turns of the scale grid."""
    repeats: int = 1
    """Timed steps per turns case (1 keeps the full run near 10 min; steps vary ~1%)."""
    scale_repeats: int = 1
    """Timed steps per scale case."""
    threads: int = 2
    """torch CPU threads."""


SMOKE = Plan(turns=(1, 2, 3), turns_shape=(2, 2), groups=(2, 4), sizes=("hard",),
             scale_mazes=2, scale_turns=2, repeats=1, scale_repeats=1)
"""Tiny sizes that take the whole code path in well under a minute."""


def cases(plan: Plan) -> list[Case]:
    """The turns sweep, then the scale grid (sizes outer, groups inner)."""
    P, G = plan.turns_shape
    out = [Case("turns", P, G, MAZE_SIZES["7x7"], t, plan.repeats, plan.threads)
           for t in plan.turns]
    out += [Case("scale", plan.scale_mazes, g, MAZE_SIZES[s], plan.scale_turns,
                 plan.scale_repeats, plan.threads) for s in plan.sizes for g in plan.groups]
    return out


def machine() -> dict[str, Any]:
    """Where and when: host facts, library versions, load average (1, 5, 15 min)."""
    import os

    import torch
    import transformers

    return {"date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "loadavg": os.getloadavg()}


def row_line(r: dict[str, Any]) -> str:
    """One printed row: shape, medians, tokens, memory."""
    name = {v: k for k, v in MAZE_SIZES.items()}[r["size"]]
    return (f"{r['section']:5} P{r['mazes']:<2} G{r['group']:<2} {name:<4} T{r['max_turns']:<2}"
            f" step {r['step_s']:6.2f} s (sync {r['sync_s']:.2f}, rollout {r['rollout_s']:6.2f},"
            f" update {r['update_s']:6.2f})  turns mean {r['mean_turns']:.2f} min"
            f" {r['min_turns']}  tokens/ep {r['tokens_per_episode']:.0f} (image"
            f" {r['image_tokens_per_episode']:.0f}, reply {r['reply_tokens_per_episode']:.0f})"
            f"  RSS base {r['base_rss_gb']:.2f} peak {r['peak_rss_gb']:.2f} GB")


def print_analysis(fits: dict[str, dict[str, float]]) -> None:
    """The linearity verdict of the turns sweep, one line per quantity."""
    for key, f in fits.items():
        line = (f"fit {key:<18} = {f['a']:8.2f} + {f['b']:7.3f} * turns; max residual "
                f"{100 * f['max_residual_frac']:.1f}%; last/first {f['ratio_last_first']:.2f}"
                f" (x ratio {f['ratio_x']:.0f}: linear through 0 = {f['ratio_x']:.0f}, "
                f"quadratic = {f['ratio_x'] ** 2:.0f}); marginal per turn "
                f"{', '.join(f'{m:.3f}' for m in f['marginal'])}")
        if "quad_c" in f:
            line += (f"; increments ratio {f['increment_ratio']:.2f} (linear 1, t^2 5/3);"
                     f" t^2 share at max {100 * f['quad_share_at_last']:+.1f}%")
        print(line)


def plot(result: dict[str, Any], path: Path) -> None:
    """Two panels: step time vs turns (with the linear fit); step time vs G per maze size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    rows = [r for r in result["rows"] if r["section"] == "turns"]
    t_N = np.array([r["max_turns"] for r in rows])
    for key, style in (("step_s", "o-"), ("rollout_s", "s--"), ("update_s", "^--")):
        ax1.plot(t_N, [r[key] for r in rows], style, label=key.removesuffix("_s"))
    fit = result["turns_fit"]["step_s"]
    ax1.plot(t_N, fit["a"] + fit["b"] * t_N, ":", color="gray", label="linear fit of step")
    P, G = rows[0]["mazes"], rows[0]["group"]
    ax1.set(xlabel="max_turns", ylabel="seconds per GRPO step",
            title=f"turns: {P} mazes x {G}, 7x7", xticks=t_N, ylim=(0, None))
    ax1.legend()
    scale = [r for r in result["rows"] if r["section"] == "scale"]
    for name, size in MAZE_SIZES.items():
        sub = [r for r in scale if r["size"] == size]
        if sub:
            g_N = [r["group"] for r in sub]
            line, = ax2.plot(g_N, [r["step_s"] for r in sub], "o-", label=f"{name} step")
            ax2.plot(g_N, [r["rollout_s"] for r in sub], "s--", color=line.get_color(),
                     alpha=0.6, label=f"{name} rollout")
            ax2.set_xticks(g_N)
    ax2.set(xlabel="G (episodes per maze)", ylabel="seconds per GRPO step", ylim=(0, None),
            title=f"scale: {scale[0]['mazes']} mazes, {scale[0]['max_turns']} turns")
    ax2.legend()
    threads = result["plan"]["threads"]
    fig.suptitle(f"GRPO step on CPU, torch threads {threads}, tiny Qwen3-VL, LoRA 32")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_plan(plan: Plan) -> dict[str, Any]:
    """Every case in its own process, printing each row as it lands; then the turns fit."""
    result: dict[str, Any] = {"plan": asdict(plan), "machine_before": machine(), "rows": []}
    t0 = time.perf_counter()
    for case in cases(plan):
        result["rows"].append(measure_in_subprocess(case))
        print(f"[{time.perf_counter() - t0:5.0f}s] {row_line(result['rows'][-1])}", flush=True)
    result["turns_fit"] = turns_analysis([r for r in result["rows"] if r["section"] == "turns"])
    result["wall_s"] = time.perf_counter() - t0
    result["machine_after"] = machine()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (< 1 min)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON (default runs/bench/scale.json, smoke: scale_smoke.json)")
    ap.add_argument("--plot", type=Path, default=None,
                    help="PNG (default docs/scale_cpu.png; smoke: runs/bench/scale_smoke.png)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per turns case")
    ap.add_argument("--scale-repeats", type=int, default=None, help="timed steps per scale case")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 2)")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child: one Case as JSON
    args = ap.parse_args()
    if args.case:
        print(json.dumps(measure_case(Case(**json.loads(args.case)))))
        return
    plan = SMOKE if args.smoke else Plan()
    overrides = {"repeats": args.repeats, "scale_repeats": args.scale_repeats,
                 "threads": args.threads}
    plan = replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    stem = "scale_smoke" if args.smoke else "scale"
    out = args.out or Path(f"runs/bench/{stem}.json")
    png = args.plot or Path("runs/bench/scale_smoke.png" if args.smoke else "docs/scale_cpu.png")
    result = run_plan(plan)
    print_analysis(result["turns_fit"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, png)
    print(f"wall {result['wall_s']:.0f} s; load before {result['machine_before']['loadavg']}, "
          f"after {result['machine_after']['loadavg']}; wrote {out} and {png}")


if __name__ == "__main__":
    main()
