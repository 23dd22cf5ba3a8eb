"""How close `workbench.estimate` comes: a pilot of --pilot steps, projected to --steps, against a
run of --steps steps of the same config, timed from the end of its start-up (session open, model
load, step-0 checkpoint) to its last write. Each run in a process of its own, so both start cold.
On the CPU with the tiny random-weights model (algorithm.advantage=parity gives every group
signal, so every step updates).

    python -m benchmarks.estimate                        # pilot 2 steps, run 6
    python -m benchmarks.estimate --pilot 3 --steps 10 generator.max_turns=5   # any key=value

Answers: How close does a pilot run's projection come to the run? Figures:
benchmarks/RESULTS.md, "What a run will take: the projection against a run".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def config(overrides: list[str], steps: int, run_dir: Path) -> Any:
    """The tiny preset with this benchmark's settings and `steps` steps."""
    from workbench.config import PRESETS, apply_overrides

    return apply_overrides(PRESETS["tiny"], [
        "model.name=tiny", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=4",
        "generator.max_turns=8", "generator.temperature=1.0", "algorithm.advantage=parity",
        "eval.n_mazes=8", "eval.sampled_passes=0", "trainer.eval_interval=2",
        "trainer.ckpt_interval=2", "trainer.hf_save_interval=3", "trainer.resume_mode=none",
        "trainer.overwrite=true", f"trainer.total_steps={steps}", f"run_dir={run_dir}",
        *overrides])


def timed_run(overrides: list[str], steps: int, run_dir: Path) -> float:
    """Seconds of a `steps`-step run after its start-up."""
    from workbench.rl.train import start, train_started

    trainer = start(config(overrides, steps, run_dir), log=lambda *_: None)
    t0 = time.perf_counter()
    trainer = train_started(trainer, log=lambda *_: None)
    seconds = time.perf_counter() - t0
    trainer.session.close()
    return seconds


def fresh_process(overrides: list[str], steps: int, run_dir: Path) -> float:
    """timed_run in a fresh Python process."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.estimate", "--run-dir", str(run_dir),
                          "--steps", str(steps), *overrides], check=True, capture_output=True,
                         text=True).stdout
    return float(out.splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pilot", type=int, default=2, help="steps of the pilot run")
    ap.add_argument("--steps", type=int, default=6, help="steps of the measured run")
    ap.add_argument("--run-dir", default="", help="only time one run of --steps steps there")
    ap.add_argument("overrides", nargs="*", help="config overrides (section.key=value)")
    args = ap.parse_args(argv)
    if args.run_dir:
        print(timed_run(args.overrides, args.steps, Path(args.run_dir)))
        return {}
    from workbench.estimate import estimate
    from workbench.run import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        fresh_process(args.overrides, args.pilot, Path(tmp) / "pilot")
        projected = estimate(Path(tmp) / "pilot", steps=args.steps)
        measured = fresh_process(args.overrides, args.steps, Path(tmp) / "full")
        step_s = [r["time/step"] for r in read_metrics(Path(tmp) / "full") if "time/step" in r]
    print("\n".join(projected.lines()[:-2]))
    result = {"pilot_steps": args.pilot, "steps": args.steps, "projected_s": projected.wall_s,
              "measured_s": measured, "error_pct": 100 * (projected.wall_s / measured - 1),
              "run_step_s": step_s}  # the measured run's own steps: how much they vary
    print("the measured run's steps (s):", " ".join(f"{s:.2f}" for s in step_s))
    print(f"projected {result['projected_s']:.1f} s, measured {measured:.1f} s: "
          f"{result['error_pct']:+.1f}%")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
