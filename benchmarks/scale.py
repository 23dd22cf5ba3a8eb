"""How the GRPO step scales on the CPU: the multi-turn cost as the turn budget grows, and step
time and memory as the group and the maze grow.

    python -m benchmarks.scale --out runs/bench/scale.json --plot docs/scale_cpu.png   # ~10 min
    python -m benchmarks.scale --smoke                                                 # < 1 min

Each case is one `python -m benchmarks.gpu --model tiny --device cpu` in a fresh process (the
product's step, untrained tiny model, LoRA r32, 2-token replies, `algorithm.advantage=parity`), so
its peak RSS is its own; one timed step, no warm-up step (on the CPU the first step times within
1% of the later ones). The untrained model never solves a maze, so every episode plays its whole
turn budget (the turns column checks it).

- turns: the demo shape (8 mazes x 8 samples, 7x7) at max_turns 5, 10, 15, with a fit
  step = a + b * turns, its largest residual, the quadratic through the points (its t^2 share at
  the longest budget) and the ratios t15/t5 (3 if proportional, 9 if quadratic) and
  (t15-t10)/(t10-t5) (1 if linear, 5/3 if quadratic).
- scale: G = 4, 8, 16 episodes per maze x easy (size 9) and hard (size 11), 8 mazes, 15 turns.

Answers: How does the CPU step grow with the turn budget and the batch? Figures:
benchmarks/RESULTS.md, "A step on the CPU".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAZE_SIZES: dict[str, int] = {"7x7": 7, "easy": 9, "hard": 11}
"""Named maze sizes counted with the outer wall (easy and hard are VisGym's)."""


@dataclass(frozen=True)
class Case:
    """One configuration, measured in its own process."""

    section: str  # turns | scale: the table the row belongs to
    mazes: int  # P
    group: int  # G
    size: int  # maze side with the outer wall
    max_turns: int
    threads: int = 2  # torch CPU threads


def measure(case: Case) -> dict[str, Any]:
    """The case's `benchmarks.gpu` summary, run in a fresh interpreter."""
    with tempfile.TemporaryDirectory(prefix="workbench-scale-") as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu", "--model", "tiny", "--device", "cpu",
               "--engine", "transformers", "--steps", "1", "--warmup", "0",
               "--mazes", str(case.mazes), "--group", str(case.group),
               "--turns", str(case.max_turns), "--max-tokens", "2",
               "--threads", str(case.threads), "--workdir", tmp, "--out", str(out),
               f"env.size={case.size}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              cwd=Path(__file__).resolve().parents[1])
        if done.returncode != 0:
            raise RuntimeError(f"case {case} failed:\n{done.stderr[-3000:]}")
        return asdict(case) | json.loads(out.read_text())


def fit_linear(x: list[float], y: list[float]) -> dict[str, Any]:
    """y = a + b x by least squares, its largest residual (fraction of y), the marginal cost
    between neighbouring points, the quadratic through the points (deg 2, exact for 3) with its
    t^2 term's share at the largest x, and the ratios last/first and of the increments."""
    x_N, y_N = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    b, a = np.polyfit(x_N, y_N, 1)
    resid_N = y_N - (a + b * x_N)
    out: dict[str, Any] = {"a": float(a), "b": float(b),
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


def turns_analysis(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """fit_linear of step, rollout, update seconds and tokens per episode against max_turns."""
    turns = [r["max_turns"] for r in rows]
    keys = ("step_s", "rollout_s", "update_s", "episode_tokens_mean")
    return {k: fit_linear(turns, [r[k] for r in rows]) for k in keys}


def cases(smoke: bool, threads: int) -> list[Case]:
    """The turns sweep, then the scale grid (sizes outer, groups inner)."""
    if smoke:
        return [Case("turns", 2, 2, 7, t, threads) for t in (1, 2, 3)] + [
            Case("scale", 2, g, 11, 2, threads) for g in (2, 4)]
    return [Case("turns", 8, 8, 7, t, threads) for t in (5, 10, 15)] + [
        Case("scale", 8, g, MAZE_SIZES[s], 15, threads) for s in ("easy", "hard")
        for g in (4, 8, 16)]


def row_line(r: dict[str, Any]) -> str:
    name = {v: k for k, v in MAZE_SIZES.items()}[r["size"]]
    return (f"{r['section']:5} P{r['mazes']:<2} G{r['group']:<2} {name:<4} T{r['max_turns']:<2}"
            f" step {r['step_s']:6.2f} s (sync {r['weight_sync_s']:.2f}, rollout "
            f"{r['rollout_s']:6.2f}, update {r['update_s']:6.2f})  turns {r['turns_mean']:.2f}"
            f"  tokens/ep {r['episode_tokens_mean']:.0f}  RSS base {r['base_rss_gb']:.2f} peak "
            f"{r['peak_rss_gb']:.2f} GB")


def print_analysis(fits: dict[str, dict[str, Any]]) -> None:
    """The linearity verdict of the turns sweep, one line per quantity."""
    for key, f in fits.items():
        line = (f"fit {key:<19} = {f['a']:8.2f} + {f['b']:7.3f} * turns; max residual "
                f"{100 * f['max_residual_frac']:.1f}%; last/first {f['ratio_last_first']:.2f}"
                f" (x ratio {f['ratio_x']:.0f}); marginal per turn "
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
    ax1.set(xlabel="max_turns", ylabel="seconds per GRPO step", xticks=t_N, ylim=(0, None),
            title=f"turns: {rows[0]['mazes']} mazes x {rows[0]['group']}, 7x7")
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
    fig.suptitle(f"GRPO step on CPU, torch threads {rows[0]['threads']}, tiny Qwen3-VL, LoRA 32")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (< 1 min)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--out", type=Path, default=Path("runs/bench/scale.json"))
    ap.add_argument("--plot", type=Path, default=Path("runs/bench/scale.png"))
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"rows": []}
    t0 = time.perf_counter()
    for case in cases(args.smoke, args.threads):
        result["rows"].append(measure(case))
        print(f"[{time.perf_counter() - t0:5.0f}s] {row_line(result['rows'][-1])}", flush=True)
    result["turns_fit"] = turns_analysis([r for r in result["rows"] if r["section"] == "turns"])
    result["wall_s"] = time.perf_counter() - t0
    print_analysis(result["turns_fit"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.plot)
    print(f"wall {result['wall_s']:.0f} s; wrote {args.out} and {args.plot}")
    return result


if __name__ == "__main__":
    main()
