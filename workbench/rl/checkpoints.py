"""A GRPO run's checkpoints and how its run folder is opened: nothing is deleted unasked, a run
resumes only with the config its checkpoint was made with (outside a small allow-list), and a
damaged checkpoint is skipped for the newest intact one.

    checkpoints/global_step_N/   state/ (weights, optimiser: session.checkpoint.save_state),
                                 trainer_state.json (step, config, python/numpy/torch RNGs),
                                 SHA256SUMS.json (sha256 + size of every file), COMPLETE (last)

    run = open_run(config, log)      # the folder, and the checkpoint to resume from (or None)

Only folders named exactly `global_step_<N>` are checkpoints; any other name under
checkpoints/ (a copy such as `global_step_4_backup`) is ignored with one line. Temporary folders
of interrupted writes (`.global_step_N.tmp-*`, `.state-tmp`) are removed at the next start with
one line. Checkpoints written before checksums (no SHA256SUMS.json) are still used, with one
line saying that only their JSON and safetensors structure was checked.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from workbench import run as rundir
from workbench import storage
from workbench.config import ConfigError, RunConfig, to_dict
from workbench.session.checkpoint import atomic_folder, has_checksums, verify_folder

TRAINER_STATE = "trainer_state.json"
STATE_TMP = ".state-tmp"  # where save_state writes before the state moves into a checkpoint
STEP_FOLDER = re.compile(r"global_step_(\d+)")

RESUMABLE = (
    "run_dir",  # where the folder is (moved, or an s3:// working copy)
    "trainer.total_steps", "trainer.ckpt_interval", "trainer.hf_save_interval",
    "trainer.eval_interval", "trainer.keep_step_records", "trainer.logger",
    "eval.*",  # what is measured, not what is trained
    "cluster.*", "storage.*",  # where it runs and where its files live
    "sft.*",  # not read by GRPO
    # memory settings that leave the update unchanged (up to float rounding):
    "trainer.minibatch", "trainer.gradient_checkpointing", "trainer.selective_checkpointing",
    "trainer.loss_tokens_only", "trainer.share_prefix", "generator.gpu_memory_utilization",
)
"""Config keys that may differ between a checkpoint and the run resuming from it; a change to
any other key is refused (ResumeConfigChanged). `section.*` allows the whole section."""

HOW_TO_START = ("trainer.resume_mode", "trainer.resume_path", "trainer.overwrite")
"""Keys that say how this start begins, not what the run is: never compared."""


class ResumeConfigChanged(ConfigError):
    """Resuming with a config that differs from the checkpoint's outside RESUMABLE."""


class CheckpointUnusable(ConfigError):
    """trainer.resume_path names a folder that is not an intact checkpoint."""


# ------------------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """The python, numpy and torch RNG states as JSON values."""
    # (numpy's stubs: get_state() is a dict or a tuple; with legacy=True, the default, a tuple)
    return {"python": repr(random.getstate()), "numpy": np.random.get_state()[1].tolist(),  # type: ignore[index]
            "torch": torch.get_rng_state().tolist()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() returned."""
    random.setstate(ast.literal_eval(state["python"]))
    np_state = np.random.get_state()
    np.random.set_state((np_state[0], np.array(state["numpy"], dtype=np.uint32), *np_state[2:]))  # type: ignore[index]
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


# ------------------------------------------------------------------------- finding checkpoints


def checkpoint_step(folder: Path) -> int | None:
    """The step of a checkpoints/global_step_N folder; None for any other name."""
    match = STEP_FOLDER.fullmatch(Path(folder).name)
    return int(match[1]) if match else None


def checkpoints_newest_first(run_dir: Path, log: Callable[[str], Any] | None = None
                             ) -> list[Path]:
    """Every checkpoints/global_step_N folder of a run (intact or not), highest step first.
    Other names are ignored: temporaries silently, anything else with one line to `log`."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if checkpoint_step(path) is not None and path.is_dir():
            found.append(path)
        elif log is not None and not storage.TEMPORARY.fullmatch(path.name):
            log(f"ignoring checkpoints/{path.name}: not a global_step_<N> checkpoint folder")
    return sorted(found, key=cast(Callable[[Path], int], checkpoint_step), reverse=True)  # all N


def checkpoint_problem(folder: Path) -> str:
    """The first problem of a checkpoint folder in one line ("" when it is intact):
    session.checkpoint.verify_folder, plus the files every checkpoint has."""
    reason = verify_folder(folder)
    if reason:
        return reason
    for name in (TRAINER_STATE, "state/COMPLETE"):
        if not (Path(folder) / name).is_file():
            return f"{name} is missing"
    return ""


def find_checkpoint(run_dir: Path, log: Callable[[str], Any] = print,
                    at_most: int | None = None) -> Path | None:
    """Newest intact checkpoint of a run (at or before step `at_most` when given). Each one
    skipped is reported in one line, e.g. "skipping checkpoint global_step_8: state/
    adapter_model.safetensors is damaged (sha256 mismatch)"; one without checksums (written
    before them) is used with a one-line note."""
    for folder in checkpoints_newest_first(run_dir, log):
        if at_most is not None and cast(int, checkpoint_step(folder)) > at_most:
            continue
        problem = checkpoint_problem(folder)
        if problem:
            log(f"skipping checkpoint {folder.name}: {problem}")
            continue
        if not has_checksums(folder):
            log(f"checkpoint {folder.name} has no SHA256SUMS.json (written before checksums): "
                "only its JSON and safetensors structure were checked")
        return folder
    return None


def save_checkpoint(trainer: Any) -> Path:
    """Full checkpoint of the trainer's current step (atomic and checksummed), then the latest
    marker (replaced atomically)."""
    folder = trainer.run_dir / "checkpoints" / f"global_step_{trainer.step}"
    state_path = trainer.training_client.save_state(trainer.run_dir / STATE_TMP).result()

    def write(tmp: Path) -> None:
        shutil.move(str(state_path), str(tmp / "state"))
        rundir.write_json(tmp / TRAINER_STATE, {
            "step": trainer.step, "config": to_dict(trainer.config), "rng": rng_state()})
    atomic_folder(folder, write)
    shutil.rmtree(state_path, ignore_errors=True)  # left only when the write above failed
    marker = trainer.run_dir / rundir.LATEST
    tmp = marker.with_name(f".{marker.name}.tmp-{os.getpid()}")
    tmp.write_text(f"{trainer.step}\n")
    os.replace(tmp, marker)
    return folder


def remove_temporaries(run_dir: Path, log: Callable[[str], Any] = print) -> list[str]:
    """Remove the temporary folders and files of interrupted writes (`.state-tmp`,
    `.<name>.tmp-*` in the run folder, checkpoints/ and exports/), in one line; returns their
    paths relative to the run folder."""
    run_dir = Path(run_dir)
    found = []
    for folder in (run_dir, run_dir / "checkpoints", run_dir / "exports"):
        if folder.is_dir():
            found += [p for p in sorted(folder.iterdir()) if storage.TEMPORARY.fullmatch(p.name)]
    for path in found:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    names = [p.relative_to(run_dir).as_posix() for p in found]
    if names:
        log(f"removed what interrupted writes left in {run_dir}: {', '.join(names)}")
    return names


# ------------------------------------------------------------------------- config on resume


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in config.items():
        if isinstance(value, dict):
            out |= {f"{name}.{k}": v for k, v in value.items()}
        else:
            out[name] = value
    return out


def _jsonable(config: RunConfig) -> dict[str, Any]:
    return _flat(json.loads(json.dumps(to_dict(config))))  # tuples as lists, as saved


def resumable(key: str) -> bool:
    """True when `key` may change on resume (RESUMABLE)."""
    return key in RESUMABLE or f"{key.split('.')[0]}.*" in RESUMABLE


def _same(key: str, old: Any, new: Any) -> bool:
    if old == new:
        return True
    if key == "model.name" and isinstance(old, str) and isinstance(new, str):  # a folder, spelt
        a, b = Path(old).expanduser(), Path(new).expanduser()  # relative vs absolute
        return a.exists() and b.exists() and a.resolve() == b.resolve()
    return False


def config_changes(saved: dict[str, Any], config: RunConfig) -> tuple[list[str], list[str]]:
    """(allowed, refused) changes from a checkpoint's saved config to `config`, each as
    'key old -> new' (values as JSON). A key the saved config lacks (added since) counts as
    its default; keys in HOW_TO_START are not compared."""
    old, new = _flat(saved), _jsonable(config)
    defaults = _jsonable(RunConfig())
    allowed: list[str] = []
    refused: list[str] = []
    for key in sorted(set(old) | set(new)):
        if key in HOW_TO_START:
            continue
        before = old.get(key, defaults.get(key, "(absent)"))
        after = new.get(key, "(absent)")
        if _same(key, before, after):
            continue
        line = f"{key} {json.dumps(before)} -> {json.dumps(after)}"
        (allowed if resumable(key) else refused).append(line)
    return allowed, refused


def check_resume_config(ckpt: Path, saved: dict[str, Any], config: RunConfig,
                        log: Callable[[str], Any] = print) -> list[str]:
    """Refuse (ResumeConfigChanged, naming each key old -> new and how to go on) a config that
    differs from the checkpoint's outside RESUMABLE; log allowed changes in one line and
    return them."""
    allowed, refused = config_changes(saved, config)
    if refused:
        raise ResumeConfigChanged(
            f"cannot resume from {ckpt} with another config: {', '.join(refused)}. Only "
            f"{', '.join(RESUMABLE)} may change on resume. Start a new run with another "
            "run_dir, or start this one over with trainer.resume_mode=none "
            "trainer.overwrite=true (which deletes it)")
    if allowed:
        note = ""
        if config.trainer.lr_schedule == "warmup_cosine" and any(
                c.startswith("trainer.total_steps ") for c in allowed):
            note = f" (the warmup_cosine schedule now ends at step {config.trainer.total_steps})"
        log(f"resuming with changed settings: {', '.join(allowed)}{note}; config.json updated")
    return allowed


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """The step, config and RNG states of a checkpoint (CheckpointUnusable when unreadable)."""
    try:
        state = json.loads((Path(ckpt) / TRAINER_STATE).read_text())
        int(state["step"]), dict(state["config"]), dict(state["rng"])
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as err:
        raise CheckpointUnusable(f"{ckpt}: {TRAINER_STATE} is unreadable ({type(err).__name__}"
                                 f": {err}): not resuming from it") from None
    return state


# ------------------------------------------------------------------------- opening a run folder


@dataclass
class OpenedRun:
    """A run folder ready for the session: fresh (checkpoint None) or resuming."""

    run_dir: Path
    checkpoint: Path | None = None
    state: dict[str, Any] = field(default_factory=dict)  # trainer_state.json when resuming
    changes: list[str] = field(default_factory=list)  # allowed config changes (key old -> new)

    @property
    def step(self) -> int:
        return int(self.state["step"]) if self.checkpoint is not None else 0


def _contents(run_dir: Path, ignore: tuple[str, ...] = ()) -> str:
    return storage.run_contents(storage.open_store(run_dir), ignore) if run_dir.is_dir() else ""


def open_run(config: RunConfig, log: Callable[[str], Any] = print) -> OpenedRun:
    """Open the run folder of `config` (s3://: its working copy, storage.open_run_dir) by
    trainer.resume_mode, deleting nothing unasked:

    - none: a folder that holds anything is refused (RunFolderExists) unless trainer.overwrite,
      which lists what is removed in one line, then removes it;
    - latest: the newest intact checkpoint (find_checkpoint); with none, a fresh start when the
      folder holds at most what a start writes first (config.json, manifest.json,
      session_spec.json), else refused unless trainer.overwrite, as for none;
    - from_path: trainer.resume_path must be intact (CheckpointUnusable names the problem); a
      checkpoint of another folder goes into an empty run folder (a non-empty one is refused
      unless trainer.overwrite) and is copied into its checkpoints/.

    A checkpoint's config must equal the current one outside RESUMABLE (check_resume_config).
    Temporaries of interrupted writes are removed with one line (remove_temporaries)."""
    t = config.trainer
    run_dir = storage.open_run_dir(config.run_dir, t.resume_mode, config.storage.endpoint_url,
                                   config.storage.local_dir, log, overwrite=t.overwrite)
    where = config.run_dir if storage.is_s3(config.run_dir) else str(run_dir)
    ckpt = None
    if t.resume_mode == "none":
        held = _contents(run_dir)
        storage.clear_or_refuse(where, held, t.overwrite, "trainer.overwrite", (
            f"run_dir {where} is not empty ({held}) and trainer.resume_mode=none starts a new "
            "run there, which would delete it: add trainer.overwrite=true to remove it, or "
            "choose another run_dir (trainer.resume_mode=latest continues it)"),
            lambda: shutil.rmtree(run_dir), log)
    elif t.resume_mode == "latest":
        ckpt = find_checkpoint(run_dir, log) if run_dir.is_dir() else None
        if ckpt is None:
            held = _contents(run_dir, storage.STARTUP_FILES)
            storage.clear_or_refuse(where, held, t.overwrite, "trainer.overwrite", (
                f"run_dir {where} holds a run ({held}) but no intact checkpoint to resume from "
                "(trainer.resume_mode=latest): add trainer.overwrite=true to remove it and "
                "start over, or choose another run_dir"), lambda: shutil.rmtree(run_dir), log)
    else:
        ckpt = _from_path(Path(t.resume_path), run_dir, where, t.overwrite, log)
    if run_dir.is_dir():
        remove_temporaries(run_dir, log)
    run_dir.mkdir(parents=True, exist_ok=True)
    if ckpt is None:
        return OpenedRun(run_dir)
    state = read_trainer_state(ckpt)
    changes = check_resume_config(ckpt, state["config"], config, log)
    return OpenedRun(run_dir, ckpt, state, changes)


def _from_path(ckpt: Path, run_dir: Path, where: str, overwrite: bool,
               log: Callable[[str], Any]) -> Path:
    problem = checkpoint_problem(ckpt)
    if problem:
        raise CheckpointUnusable(f"trainer.resume_path={ckpt}: {problem}: not resuming from it")
    if ckpt.resolve().parent == (run_dir / "checkpoints").resolve():
        return ckpt  # an earlier checkpoint of this same run
    held = _contents(run_dir)
    storage.clear_or_refuse(where, held, overwrite, "trainer.overwrite", (
        f"run_dir {where} is not empty ({held}) and is not the run of trainer.resume_path="
        f"{ckpt}: add trainer.overwrite=true to remove it, or choose another run_dir"),
        lambda: shutil.rmtree(run_dir), log)
    step = read_trainer_state(ckpt)["step"]
    copy = run_dir / "checkpoints" / f"global_step_{int(step)}"
    shutil.copytree(ckpt, copy)
    (run_dir / rundir.LATEST).write_text(f"{int(step)}\n")
    log(f"copied {ckpt} to {copy}")
    return copy
