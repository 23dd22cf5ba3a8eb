"""Plot the H200 scale and multi-turn figures from the JSON that benchmarks/gpu.py wrote.

    .venv/bin/python benchmarks/plot_gpu.py --runs benchmarks/gpu_runs/run8.json \
        benchmarks/gpu_runs/run9.json benchmarks/gpu_runs/run10.json --out docs/scale_h200.png

Three panels: step, rollout and update seconds against max_turns (the `turns` section); step
seconds against G for easy and hard mazes (the `scale` section; one-time graph captures left
out of the rollout, as in RESULTS.md); peak GPU memory of sampler and trainer against G.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

MAZES = {9: "easy 9x9", 11: "hard 11x11"}


def load_rows(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(turns rows, scale rows) of all runs, each sorted; skipped scale rows left out."""
    turns, scale = [], []
    for path in paths:
        result = json.loads(path.read_text())
        turns += result.get("turns", [])
        scale += [r for r in result.get("scale", []) if "skipped" not in r]
    return sorted(turns, key=lambda r: r["turns"]), sorted(scale, key=lambda r: (r["size"], r["G"]))


def without_captures(r: dict[str, Any]) -> tuple[float, float]:
    """(step s, rollout s) of a row without its one-time CUDA-graph captures."""
    captures = r["graph_capture_s_in_rollout"]
    return r["step_s"] - captures, r["rollout_s"] - captures


def plot(turns: list[dict[str, Any]], scale: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    t_N = [r["turns"] for r in turns]
    for key, style in (("step_s", "o-"), ("rollout_s", "s--"), ("update_s", "^--")):
        ax1.plot(t_N, [r[key] for r in turns], style, label=key.removesuffix("_s"))
    ax1.set(xlabel="max_turns", ylabel="seconds per GRPO step", xticks=t_N, ylim=(0, None),
            title="turns: 8 mazes x 8, easy (run 10)")
    ax1.legend()
    for size, name in MAZES.items():
        sub = [r for r in scale if r["size"] == size]
        if not sub:
            continue
        g_N = [r["G"] for r in sub]
        line, = ax2.plot(g_N, [without_captures(r)[0] for r in sub], "o-", label=f"{name} step")
        ax2.plot(g_N, [without_captures(r)[1] for r in sub], "s--", color=line.get_color(),
                 alpha=0.6, label=f"{name} rollout")
        ax3.plot(g_N, [r["trainer_peak_gb"] for r in sub], "o-", color=line.get_color(),
                 label=f"{name} trainer")
        ax3.plot(g_N, [r["sampler_peak_gb"] for r in sub], "s--", color=line.get_color(),
                 alpha=0.6, label=f"{name} sampler")
        ax2.set_xticks(g_N)
        ax3.set_xticks(g_N)
    ax2.set(xlabel="G (episodes per maze)", ylabel="seconds per GRPO step", ylim=(0, None),
            title="scale: 8 mazes, 15 turns (runs 8-9)")
    ax3.axhline(150, color="gray", linestyle=":", label="H200 (150 GB)")
    ax3.set(xlabel="G (episodes per maze)", ylabel="peak GB", ylim=(0, 160),
            title="peak GPU memory (runs 8-9)")
    ax2.legend()
    ax3.legend(fontsize=8)
    fig.suptitle("GRPO step of the Qwen3-VL-8B shape on one H200 (bf16, LoRA 32, compiled "
                 "fused decode, compiled layers)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, nargs="+", required=True)
    ap.add_argument("--out", type=Path, default=Path("docs/scale_h200.png"))
    args = ap.parse_args()
    turns, scale = load_rows(args.runs)
    plot(turns, scale, args.out)
    print(f"wrote {args.out}: {len(turns)} turns rows, {len(scale)} scale rows")


if __name__ == "__main__":
    main()
