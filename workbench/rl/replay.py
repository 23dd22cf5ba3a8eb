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
from workbench.model import LoraSettings
from workbench.rl import phases
from workbench.rl.train import checkpoint_step, checkpoints_newest_first
from workbench.session import AdamParams, LossConfig, create_session
from workbench.session.checkpoint import is_complete

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
        return all(self.logged[k] == self.replayed[k] for k in COMPARED)


def _checkpoint_before(run_dir: Path, step: int) -> Path:
    for folder in checkpoints_newest_first(run_dir):
        if checkpoint_step(folder) < step and is_complete(folder):
            return folder
    raise FileNotFoundError(f"no complete checkpoint before step {step} in {run_dir}")


def _update_from_record(training_client, folder: Path, config: RunConfig) -> dict[str, float]:
    record = rundir.load_step_record(folder)
    datums = rundir.load_datums(folder, training_client.get_processor(), config.maze)
    up = phases.update(training_client, datums, record["loss_fn"],
                       LossConfig(**record["loss_config"]), AdamParams(**record["adam"]),
                       config.trainer.minibatch)
    return {"update/loss": up.metrics.get("loss", 0.0),
            "update/kl_sampler_trainer": up.metrics.get("kl_sampler_trainer", 0.0),
            "update/entropy": up.metrics.get("entropy", 0.0),
            "update/clip_fraction": up.metrics.get("clip_fraction", 0.0),
            "update/tokens": up.metrics.get("tokens", 0), "update/grad_norm": up.grad_norm,
            "update/datums": up.datums}


def replay(run_dir: str | Path, step: int) -> ReplayResult:
    """Reproduce step `step`'s update from its record and the state before it."""
    run_dir = Path(run_dir)
    config = from_dict(json.loads((run_dir / "config.json").read_text()))
    ckpt = _checkpoint_before(run_dir, step)
    start = checkpoint_step(ckpt)
    session = create_session(config.model.name, LoraSettings(config.lora.rank, config.lora.alpha),
                             workdir=run_dir / "replay", dtype=getattr(torch, config.model.dtype),
                             device=config.model.device)
    tc = session.training_client
    tc.load_state(ckpt / "state").result()
    for s in range(start + 1, step):
        _update_from_record(tc, run_dir / "steps" / f"step_{s:06d}", config)
    folder = run_dir / "steps" / f"step_{step:06d}"
    replayed = _update_from_record(tc, folder, config)
    logged = rundir.load_step_record(folder)["metrics"]
    session.close()
    return ReplayResult(step, {k: logged[k] for k in COMPARED}, replayed, start)
