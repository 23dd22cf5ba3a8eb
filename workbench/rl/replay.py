"""Replay a recorded step: load the state before it, re-run its update on the recorded batch.

    result = replay("runs/grpo", step=7)
    result.logged["update/loss"] == result.replayed["update/loss"]   # exact on CPU

The state before step k is the newest checkpoint at or before k-1, advanced by re-running the
recorded updates in between (every step's batch is kept), so any step can be replayed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench import run as rundir
from workbench.config import RunConfig, from_dict
from workbench.envs.tasks import TASKS
from workbench.opener import open_session, session_spec
from workbench.rl import phases
from workbench.runfolder import find_checkpoint, step_of
from workbench.session import AdamParams, LossConfig

COMPARED = ("update/loss", "update/kl_sampler_trainer", "update/entropy",
            "update/clip_fraction", "update/tokens", "update/grad_norm", "update/datums")


@dataclass
class ReplayResult:
    """Logged and replayed update metrics of one step."""

    step: int
    logged: dict[str, float]
    replayed: dict[str, float]
    from_checkpoint: int

    @property
    def exact(self) -> bool:
        """Every compared metric the step logged equals its replayed value (a step without an
        update logged only its datum count, 0)."""
        return self.logged.keys() == self.replayed.keys() and all(
            self.logged[k] == self.replayed[k] for k in self.logged)


def _checkpoint_before(run_dir: Path, step: int) -> Path:
    """The newest intact checkpoint before `step` (a damaged one is skipped with one line)."""
    folder = find_checkpoint(run_dir, print, at_most=step - 1)
    if folder is None:
        raise FileNotFoundError(f"no intact checkpoint before step {step} in {run_dir} (a run "
                                "with trainer.ckpt_interval=0 keeps none, so it cannot replay)")
    return folder


def _update_from_record(training_client, folder: Path, config: RunConfig) -> dict[str, float]:
    record = rundir.load_step_record(folder)
    datums = rundir.load_datums(folder, training_client.get_processor(),
                                TASKS[config.env.task].recorded_maze, config.env.px_per_cell)
    if not datums:  # the step made no update (train_step skips it), nor does its replay
        return {"update/datums": 0}
    a = config.algorithm
    up = phases.update(training_client, datums, phases.UpdateSettings(
        record["loss_fn"], LossConfig(**record["loss_config"]), AdamParams(**record["adam"]),
        a.minibatch, a.mini_batches, a.update_epochs))
    return {"update/loss": up.metrics["loss"],
            "update/kl_sampler_trainer": up.metrics["kl_sampler_trainer"],
            "update/entropy": up.metrics["entropy"],
            "update/clip_fraction": up.metrics["clip_fraction"],
            "update/tokens": up.metrics["tokens"], "update/grad_norm": up.grad_norm,
            "update/datums": up.datums}


class ReplayError(ValueError):
    """A step that cannot be replayed from this run folder (no record of it or before it)."""


def recorded_steps(run_dir: Path) -> list[int]:
    """The steps whose record (steps/step_N/) the run kept, in order."""
    return sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "steps").glob("step_*")
                  if p.name.removeprefix("step_").isdigit() and (p / "episodes.json").is_file())


def check_replayable(run_dir: Path, step: int) -> None:
    """Raise ReplayError in one line unless the run folder has step `step` and every step
    between its checkpoint and it."""
    if not (run_dir / "config.json").is_file():
        raise ReplayError(f"{run_dir} is not a run folder (no config.json)")
    steps = recorded_steps(run_dir)
    if not steps:
        raise ReplayError(f"{run_dir} has no step records (steps/ is empty: the run had "
                          "trainer.keep_step_records=false, or made no step)")
    if step not in steps:
        raise ReplayError(f"step {step} is not recorded in {run_dir}; recorded steps: "
                          f"{step_list(steps)}")


def step_list(steps: list[int]) -> str:
    """Sorted step numbers in short: runs of three or more as "a..b", e.g. "1, 2" or "1..40, 45"."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}..{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def replay(run_dir: str | Path, step: int) -> ReplayResult:
    """Reproduce step `step`'s update from its record and the state before it, with the torch
    thread count the run trained with (manifest.json): CPU matmuls split their sums by thread,
    so another count changes the last bits."""
    run_dir = Path(run_dir)
    check_replayable(run_dir, step)
    threads = json.loads((run_dir / "manifest.json").read_text()).get("torch_threads")
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return _replay(run_dir, step)
    finally:
        torch.set_num_threads(before)


def _replay(run_dir: Path, step: int) -> ReplayResult:
    config = from_dict(json.loads((run_dir / "config.json").read_text()))
    ckpt = _checkpoint_before(run_dir, step)
    start = step_of(ckpt)
    assert start is not None, ckpt  # find_checkpoint returns global_step_N folders only
    session = open_session(session_spec(config, run_dir / "replay"))  # the run's own spec
    tc = session.training_client
    tc.load_state(ckpt / "state").result()
    for s in range(start + 1, step):
        _update_from_record(tc, run_dir / "steps" / f"step_{s:06d}", config)
    folder = run_dir / "steps" / f"step_{step:06d}"
    replayed = _update_from_record(tc, folder, config)
    logged = rundir.load_step_record(folder)["metrics"]
    session.close()
    return ReplayResult(step, {k: logged[k] for k in COMPARED if k in logged}, replayed, start)
