"""What a run will cost: a short pilot run's folder projected to the full run's wall time and price.

    python -m workbench estimate runs/pilot --steps 100 --price-per-gpu-hour 3.5

The model, from what the pilot's metrics.jsonl and folder hold:
- a step: the median steady-state step (by time/step; step 1 is skipped as warm-up when the pilot
  has more than one step; the lower middle one of an even count), split into its phases
  (time/rollout_wait, time/weight_sync, time/update, the rest of time/step), times the steps;
- an evaluation: the median time/eval of the eval rows after step 0 (the step-0 one is warm-up
  too; it alone when there is no other), times the evaluations the full run makes (step 0,
  every multiple of trainer.eval_interval, the last step);
- a checkpoint / an adapter export: not timed in metrics.jsonl, so the median span of the file
  times inside the pilot's checkpoints/global_step_N (exports/global_step_N) folders, a lower
  bound, times the full run's count from trainer.ckpt_interval (step 0 included) and
  trainer.hf_save_interval (the last step included).
Start-up (opening the session, loading the model) is not counted. The cost is hours times the
price per GPU-hour times the run's GPUs (1 in-process on CUDA; on Ray max(N, M) trainer workers
N and engines M with cluster.colocate_all, N + M without), plus any price per machine-hour (a CPU
run has 0 GPUs: only --price-per-hour applies).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from workbench.config import RunConfig, from_dict
from workbench.run import read_metrics
from workbench.runfolder import CHECKPOINTS, EXPORTS, step_of


class EstimateError(ValueError):
    """The folder is not a run folder with at least one logged step."""


@dataclass(frozen=True)
class PhaseCost:
    """One line of the projection."""

    phase: str
    """rollout | weight_sync | update | step_rest | eval | checkpoint | export."""
    seconds: float
    """Seconds one occurrence takes in the pilot."""
    count: int
    """Occurrences in the full run."""

    @property
    def total(self) -> float:
        return self.seconds * self.count


@dataclass(frozen=True)
class Estimate:
    """A pilot run projected to `steps` steps."""

    run_dir: str
    """The pilot's run folder."""
    steps: int
    """Steps of the projected run (trainer.total_steps unless overridden)."""
    pilot_steps: tuple[int, ...]
    """The pilot's steps whose median step the projection uses."""
    phases: tuple[PhaseCost, ...]
    """Seconds per occurrence and occurrences, phase by phase."""
    gpus: int
    """GPUs the run's config holds (0 on CPU)."""
    price_per_gpu_hour: float | None
    """Price of one GPU-hour (None: not given)."""
    price_per_hour: float | None
    """Price of one machine-hour, added to the GPUs' (None: not given)."""

    @property
    def wall_s(self) -> float:
        return sum(p.total for p in self.phases)

    @property
    def cost(self) -> float | None:
        if self.price_per_gpu_hour is None and self.price_per_hour is None:
            return None
        hourly = (self.price_per_gpu_hour or 0.0) * self.gpus + (self.price_per_hour or 0.0)
        return self.wall_s / 3600 * hourly

    def lines(self) -> list[str]:
        """The table, the wall-time line, the cost line and a JSON line."""
        skipped = "step 1 skipped as warm-up" if 1 not in self.pilot_steps else "no warm-up skipped"
        rows = [f"{self.run_dir}: median of pilot steps {list(self.pilot_steps)} ({skipped})",
                f"{'phase':<12}{'s each':>10}{'times':>8}{'total s':>12}"]
        rows += [f"{p.phase:<12}{p.seconds:>10.3f}{p.count:>8}{p.total:>12.1f}"
                 for p in self.phases]
        rows.append(f"wall time: {self.wall_s:.1f} s ({self.wall_s / 3600:.2f} h) for "
                    f"{self.steps} steps, start-up not counted")
        price = f"{self.price_per_gpu_hour} per GPU-hour x {self.gpus} GPU" \
            if self.price_per_gpu_hour is not None else ""
        if self.price_per_hour is not None:
            price += (" + " if price else "") + f"{self.price_per_hour} per machine-hour"
        rows.append(f"cost: {self.cost:.2f} at {price}" if self.cost is not None else
                    f"cost: no price given ({self.gpus} GPU; --price-per-gpu-hour P, "
                    "--price-per-hour P for a machine)")
        record = asdict(self) | {"wall_s": self.wall_s, "cost": self.cost}
        return rows + [json.dumps(record)]


def estimate(run_dir: str | Path, steps: int | None = None,
             price_per_gpu_hour: float | None = None,
             price_per_hour: float | None = None) -> Estimate:
    """Project the pilot run in `run_dir` to `steps` steps (default: its trainer.total_steps)."""
    run = Path(run_dir)
    if not (run / "config.json").is_file():
        raise EstimateError(f"{run} is not a run folder (no config.json)")
    config = from_dict(json.loads((run / "config.json").read_text()))
    rows = read_metrics(run)
    step_rows = {r["step"]: r for r in rows if "time/step" in r}
    if not step_rows:
        raise EstimateError(f"{run}/metrics.jsonl has no step rows: run the pilot for a step")
    steady = [r for s, r in sorted(step_rows.items()) if s > 1] or list(step_rows.values())
    median = statistics.median_low(r["time/step"] for r in steady)
    row = next(r for r in steady if r["time/step"] == median)
    n = steps or config.trainer.total_steps
    evals_all = [r for r in rows if "time/eval" in r]
    evals = [r["time/eval"] for r in evals_all if r["step"] > 0] or \
        [r["time/eval"] for r in evals_all]
    phases = step_phases(row, n) + [
        PhaseCost("eval", statistics.median(evals) if evals else 0.0, eval_count(config, n)),
        PhaseCost("checkpoint", write_seconds(run / CHECKPOINTS), checkpoint_count(config, n)),
        PhaseCost("export", write_seconds(run / EXPORTS), export_count(config, n))]
    return Estimate(str(run), n, tuple(r["step"] for r in steady), tuple(phases),
                    gpu_count(config), price_per_gpu_hour, price_per_hour)


def step_phases(row: dict[str, Any], steps: int) -> list[PhaseCost]:
    """One step row's phases (the rest of time/step: scoring, datums, logging), each `steps`
    times; rollout is the time the step waited for its rollout (all of it without look-ahead)."""
    rollout = row.get("time/rollout_wait", row.get("time/rollout", 0.0))
    sync, update = row.get("time/weight_sync", 0.0), row.get("time/update", 0.0)
    rest = max(row["time/step"] - rollout - sync - update, 0.0)
    return [PhaseCost(name, seconds, steps) for name, seconds in
            (("rollout", rollout), ("weight_sync", sync), ("update", update), ("step_rest", rest))]


def eval_count(config: RunConfig, steps: int) -> int:
    """Evaluations of a `steps`-step run: step 0's, then each step the loop evaluates after."""
    return 1 + sum(config.trainer.eval_due(s, steps) for s in range(1, steps + 1))


def checkpoint_count(config: RunConfig, steps: int) -> int:
    """Full checkpoints of a `steps`-step run, step 0's included."""
    return sum(config.trainer.checkpoint_due(s) for s in range(steps + 1))


def export_count(config: RunConfig, steps: int) -> int:
    """Adapter exports of a `steps`-step run."""
    return sum(config.trainer.export_due(s, steps) for s in range(1, steps + 1))


def gpu_count(config: RunConfig) -> int:
    """GPUs the run holds: 0 on CPU, 1 in-process, its Ray placement's bundles otherwise."""
    if not config.model.device.startswith("cuda"):
        return 0
    c = config.cluster
    if not c.address:
        return 1
    return max(c.num_workers, c.num_engines) if c.colocate_all else c.num_workers + c.num_engines


def write_seconds(parent: Path) -> float:
    """Median over the global_step_N folders under `parent` of the span of their files' times
    (first file written to last): a lower bound of one write; 0.0 when there is none."""
    spans = []
    for folder in parent.glob("global_step_*"):
        times = [p.stat().st_mtime for p in folder.rglob("*") if p.is_file()]
        if step_of(folder) is not None and times:
            spans.append(max(times) - min(times))
    return statistics.median(spans) if spans else 0.0
