"""A run folder: its layout, its checkpoints and how a start opens it, written once for a local
folder and an s3:// prefix (trained in a local working copy) alike.

    run_dir/                         a local folder, or s3://bucket/prefix
      config.json  manifest.json  session_spec.json  metrics.jsonl  eval/  steps/  (workbench.run)
      checkpoints/global_step_20/    state/ (session.checkpoint.save_state), trainer_state.json
                                     (step, config, RNG states), SHA256SUMS.json, COMPLETE (last)
      latest_checkpointed_iteration.txt                 the newest checkpoint's step (SkyRL's)
      exports/global_step_20/                           PEFT adapter

    run = open_run(config, log)      # the local folder, and the checkpoint to resume from (or None)
    save_checkpoint(run.run_dir, step, training_client, config)
    mirror_run(run.run_dir, config)  # s3://: upload what is new (checkpoint folders whole)

Nothing is deleted unasked (REFUSALS, unless trainer.overwrite, which lists what goes in one
line); a run resumes only with its checkpoint's config outside RESUMABLE; the newest intact
`global_step_<N>` checkpoint is used, each damaged one above it reported in one line (other
names are ignored); temporaries of interrupted writes are removed at the next start. An s3://
run's working copy (storage.local_dir, else $WORKBENCH_CACHE/runs/<bucket>/<prefix>) is made
afresh at every start; resuming downloads the newest intact checkpoint into it (never a torn
upload), then config, manifest, metrics, the latest marker and eval results.
"""

from __future__ import annotations

import ast
import json
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench import storage
from workbench.config import ConfigError, RunConfig, knobs_moved, to_dict
from workbench.model.tiny import cache_root
from workbench.session.checkpoint import (
    COMPLETE,
    INCOMPLETE,
    atomic_folder,
    atomic_write,
    has_checksums,
    verify_folder,
)
from workbench.session.clients import TrainingClient
from workbench.storage import IncompleteUpload, StorageError, Store

Log = Callable[[str], Any]

# ------------------------------------------------------------------------- the layout

CHECKPOINTS, EXPORTS = "checkpoints", "exports"  # folders of global_step_N entries
STEP_FOLDER = re.compile(r"global_step_(\d+)")
TRAINER_STATE = "trainer_state.json"  # in a checkpoint: step, config, RNG states
LATEST = "latest_checkpointed_iteration.txt"  # the newest checkpoint's step, written after it
STATE_TMP = ".state-tmp"  # where a checkpoint's state is saved before it moves in
TEMPORARY = re.compile(rf"{re.escape(STATE_TMP)}|\..+\.tmp-.*")  # left by interrupted writes
STARTUP_FILES = ("config.json", "manifest.json", "session_spec.json")
"""What a start writes before its first checkpoint (resume_mode=latest with nothing to resume
starts afresh over them)."""
RESUME_FILES = ("config.json", "manifest.json", "metrics.jsonl", LATEST)  # + eval/ (from S3)
_COUNTED = {CHECKPOINTS: "checkpoint", EXPORTS: "export", "eval": "eval result",
            "steps": "step record"}


def step_folder(step: int) -> str:
    """The name of step N's checkpoint or export folder: global_step_N."""
    return f"global_step_{step}"


def step_of(folder: str | Path) -> int | None:
    """The step of a global_step_N folder; None for any other name (global_step_4_old)."""
    match = STEP_FOLDER.fullmatch(Path(folder).name)
    return int(match[1]) if match else None


class RunFolderExists(StorageError):
    """A start that would delete what a run folder (or S3 prefix) holds without being asked."""


class ResumeConfigChanged(ConfigError):
    """Resuming with a config that differs from the checkpoint's outside RESUMABLE."""


class CheckpointUnusable(ConfigError):
    """trainer.resume_path names a folder that is not an intact checkpoint."""


@dataclass(frozen=True)
class RunFolder:
    """Where a run lives (a local folder or an s3:// prefix) and the local folder it writes:
    that folder itself, or the prefix's working copy."""

    store: Store
    local: Path

    @property
    def where(self) -> str:
        """run_dir as messages name it."""
        return self.store.root if self.store.s3 else str(self.local)


def local_run(run_dir: str | Path) -> RunFolder:
    """A run folder on this machine."""
    return RunFolder(storage.open_store(run_dir), Path(run_dir))


# ------------------------------------------------------------------------- what it holds


def run_contents(store: Store, ignore: tuple[str, ...] = ()) -> str:
    """What a run folder or S3 prefix holds, in one phrase ("" when nothing): counts for
    checkpoints, exports, eval results and step records, metrics.jsonl with its rows, then
    every other name, e.g. "3 checkpoints, 2 exports, metrics.jsonl (12 rows), config.json".
    Temporaries of interrupted writes, a working copy's upload record and `ignore`d names are
    left out."""
    counted, others = {}, []
    for name in storage.list_dir(store):
        if name in ignore or name == storage.MIRROR_STATE or TEMPORARY.fullmatch(name):
            continue
        if name in _COUNTED:
            n = len([e for e in storage.list_dir(store, name) if not TEMPORARY.fullmatch(e)])
            counted[name] = f"{n} {_COUNTED[name]}{'s' if n != 1 else ''}"
        elif name == "metrics.jsonl":
            rows = sum(1 for line in storage.read_bytes(store, name).splitlines() if line.strip())
            counted[name] = f"metrics.jsonl ({rows} row{'s' if rows != 1 else ''})"
        else:
            others.append(name)
    order = [*_COUNTED, "metrics.jsonl"]
    return ", ".join([counted[k] for k in order if k in counted] + others)


REFUSALS = {
    "none": "run_dir {where} is not empty ({held}) and trainer.resume_mode=none starts a new run "
            "there, which would delete it: add trainer.overwrite=true to remove it, or choose "
            "another run_dir (trainer.resume_mode=latest continues it)",
    "latest": "run_dir {where} holds a run ({held}) but no intact checkpoint to resume from "
              "(trainer.resume_mode=latest): add trainer.overwrite=true to remove it and start "
              "over, or choose another run_dir",
    "from_path": "run_dir {where} is not empty ({held}) and is not the run of "
                 "trainer.resume_path={resume_path}: add trainer.overwrite=true to remove it, or "
                 "choose another run_dir",
    "sft": "run_dir {where} is not empty ({held}) and sft would delete it: add "
           "sft.overwrite=true to remove it, or choose another run_dir",
}
"""Why a start refuses a run folder that holds something, by the start that would delete it."""


def clear_or_refuse(run: RunFolder, why: str, overwrite: bool, log: Log, **details: Any) -> None:
    """Nothing when the run folder (or prefix) is empty, for why="latest" when it holds at most
    STARTUP_FILES; else RunFolderExists(REFUSALS[why]) unless `overwrite`, which logs
    "trainer.overwrite=true: removing <where>: <what it holds>" (sft.overwrite for sft) and
    empties it."""
    held = run_contents(run.store, STARTUP_FILES if why == "latest" else ())
    if not held:
        return
    if not overwrite:
        raise RunFolderExists(REFUSALS[why].format(where=run.where, held=held, **details))
    log(f"{'sft' if why == 'sft' else 'trainer'}.overwrite=true: removing {run.where}: {held}")
    storage.delete(run.store, "")


# ------------------------------------------------------------------------- checkpoints


CHECKPOINT_FILES = (TRAINER_STATE, f"state/{COMPLETE}")  # what every checkpoint holds


def find_checkpoint(run: RunFolder | str | Path, log: Log = print,
                    at_most: int | None = None) -> Path | None:
    """The newest intact checkpoint of a run (at or before step `at_most` when given) as a
    local folder: a local run's own, or one of an s3:// prefix downloaded into its working copy
    (a torn upload is not; a damaged one is removed again). Each one skipped is reported in one
    line, e.g. "skipping checkpoint global_step_8: state/adapter_model.safetensors is damaged
    (sha256 mismatch)"; one without checksums (written before them) is used with a one-line
    note. Names other than global_step_N are ignored: temporaries silently, anything else with
    one line."""
    run = run if isinstance(run, RunFolder) else local_run(run)
    names = [n for n in storage.list_dir(run.store, CHECKPOINTS) if not TEMPORARY.fullmatch(n)]
    steps = {name: step for name in names if (step := step_of(name)) is not None}
    for name in sorted(set(names) - set(steps)):
        log(f"ignoring checkpoints/{name}: not a global_step_<N> checkpoint folder")
    for name in sorted(steps, key=steps.__getitem__, reverse=True):
        if at_most is not None and steps[name] > at_most:
            continue
        folder, problem = run.local / CHECKPOINTS / name, ""
        if run.store.s3:
            try:
                storage.get_folder(run.store, f"{CHECKPOINTS}/{name}", folder)
            except IncompleteUpload:
                problem = INCOMPLETE
        problem = problem or verify_folder(folder, CHECKPOINT_FILES)
        if problem:
            log(f"skipping checkpoint {name}: {problem}")
            if run.store.s3 and folder.is_dir():
                shutil.rmtree(folder)
            continue
        if not has_checksums(folder):
            log(f"checkpoint {name} has no SHA256SUMS.json (written before checksums): only its "
                "JSON and safetensors structure were checked")
        return folder
    return None


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


def save_checkpoint(run_dir: Path, step: int, training_client: TrainingClient,
                    config: RunConfig) -> Path:
    """checkpoints/global_step_<step>: the session's state (weights, optimiser) and
    trainer_state.json (step, config, RNG states), atomic and checksummed; then the latest
    marker (replaced atomically)."""
    folder = run_dir / CHECKPOINTS / step_folder(step)
    state_path = Path(training_client.save_state(run_dir / STATE_TMP).result())

    def write(tmp: Path) -> None:
        shutil.move(str(state_path), str(tmp / "state"))
        (tmp / TRAINER_STATE).write_text(json.dumps(
            {"step": step, "config": to_dict(config), "rng": rng_state()}, indent=1))
    atomic_folder(folder, write)
    shutil.rmtree(state_path, ignore_errors=True)  # left only when the write above failed
    atomic_write(run_dir / LATEST, f"{step}\n".encode())
    return folder


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """The step, config and RNG states of a checkpoint (CheckpointUnusable when unreadable)."""
    try:
        state = json.loads((Path(ckpt) / TRAINER_STATE).read_text())
        int(state["step"]), dict(state["config"]), dict(state["rng"])
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as err:
        raise CheckpointUnusable(f"{ckpt}: {TRAINER_STATE} is unreadable ({type(err).__name__}"
                                 f": {err}): not resuming from it") from None
    return state


def remove_temporaries(run_dir: Path, log: Log = print) -> list[str]:
    """Remove what interrupted writes left (`.state-tmp`, `.<name>.tmp-*` in the run folder,
    checkpoints/ and exports/), in one line; returns their paths relative to the run folder."""
    run_dir = Path(run_dir)
    found = []
    for folder in (run_dir, run_dir / CHECKPOINTS, run_dir / EXPORTS):
        if folder.is_dir():
            found += [p for p in sorted(folder.iterdir()) if TEMPORARY.fullmatch(p.name)]
    for path in found:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    names = [p.relative_to(run_dir).as_posix() for p in found]
    if names:
        log(f"removed what interrupted writes left in {run_dir}: {', '.join(names)}")
    return names


# ------------------------------------------------------------------------- config on resume

RESUMABLE = (
    "run_dir",  # where the folder is (moved, or an s3:// working copy)
    "trainer.total_steps", "trainer.ckpt_interval", "trainer.hf_save_interval",
    "trainer.eval_interval", "trainer.keep_step_records", "trainer.logger",
    "eval.*",  # what is measured, not what is trained
    "cluster.*", "storage.*",  # where it runs and where its files live
    "sft.*",  # not read by GRPO
    # memory settings that leave the update unchanged (up to float rounding):
    "algorithm.minibatch", "speed.gradient_checkpointing", "speed.selective_checkpointing",
    "speed.loss_tokens_only", "speed.share_prefix", "engine.gpu_memory_utilization",
)
"""Config keys that may differ between a checkpoint and the run resuming from it; a change to
any other key is refused (ResumeConfigChanged). `section.*` allows the whole section."""

HOW_TO_START = ("trainer.resume_mode", "trainer.resume_path", "trainer.overwrite")
"""Keys that say how this start begins, not what the run is: never compared."""


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
    old, new = _flat(knobs_moved(saved)), _jsonable(config)
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
                        log: Log = print) -> list[str]:
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
        if config.algorithm.lr_schedule == "warmup_cosine" and any(
                c.startswith("trainer.total_steps ") for c in allowed):
            note = f" (the warmup_cosine schedule now ends at step {config.trainer.total_steps})"
        log(f"resuming with changed settings: {', '.join(allowed)}{note}; config.json updated")
    return allowed


# ------------------------------------------------------------------------- opening a run


@dataclass
class OpenedRun:
    """A run folder ready for the session: fresh (checkpoint None) or resuming."""

    run_dir: Path  # the local folder the run writes
    checkpoint: Path | None = None
    state: dict[str, Any] = field(default_factory=dict)  # trainer_state.json when resuming
    changes: list[str] = field(default_factory=list)  # allowed config changes (key old -> new)

    @property
    def step(self) -> int:
        return int(self.state["step"]) if self.checkpoint is not None else 0


def open_run(config: RunConfig, log: Log = print) -> OpenedRun:
    """Open the run folder of `config` (a local folder, or an s3:// prefix through its working
    copy) by trainer.resume_mode, deleting nothing unasked (clear_or_refuse):

    - none: the folder must be empty;
    - latest: the newest intact checkpoint (find_checkpoint); with none, a fresh start when the
      folder holds at most STARTUP_FILES, else refused;
    - from_path: trainer.resume_path must be intact (CheckpointUnusable names the problem); a
      checkpoint of another run goes into an empty folder and is copied into its checkpoints/.

    A checkpoint's config must equal the current one outside RESUMABLE (check_resume_config).
    Temporaries of interrupted writes are removed with one line (remove_temporaries)."""
    t = config.trainer
    run = open_folder(config)
    ckpt = None
    if t.resume_mode == "latest":
        ckpt = find_checkpoint(run, log)
        if ckpt is None:
            clear_or_refuse(run, "latest", t.overwrite, log)
        elif run.store.s3:
            _download_for_resume(run)
    elif t.resume_mode == "from_path":
        ckpt = _from_path(Path(t.resume_path), run, t.overwrite, log)
    else:
        clear_or_refuse(run, "none", t.overwrite, log)
    remove_temporaries(run.local, log)
    run.local.mkdir(parents=True, exist_ok=True)
    if run.store.s3:
        log(f"run directory {run.store.root} (working copy {run.local})")
    if ckpt is None:
        return OpenedRun(run.local)
    state = read_trainer_state(ckpt)
    return OpenedRun(run.local, ckpt, state, check_resume_config(ckpt, state["config"], config,
                                                                 log))


def open_folder(config: RunConfig) -> RunFolder:
    """config.run_dir, checked: a local one must be a folder (or not exist yet); an s3:// one
    must name a prefix, and gets a fresh working copy (storage.local_dir, else
    $WORKBENCH_CACHE/runs/<bucket>/<prefix>), which must be empty or an earlier working copy."""
    store = storage.open_store(config.run_dir, config.storage.endpoint_url)
    if not store.s3:
        if Path(config.run_dir).exists() and not Path(config.run_dir).is_dir():
            raise StorageError(f"run_dir {config.run_dir} is a file, not a folder: choose "
                               "another run_dir")
        return RunFolder(store, Path(config.run_dir))
    if not store.prefix:
        raise StorageError(f"run_dir={config.run_dir!r} is a whole bucket: use "
                           "s3://bucket/prefix")
    local = Path(config.storage.local_dir) if config.storage.local_dir else (
        cache_root() / "runs" / store.root[5:])
    if local.is_dir() and any(local.iterdir()) and not storage.is_working_copy(local):
        raise RunFolderExists(f"the working copy {local} of run_dir={store.root} is a folder "
                              "that holds other files: choose an empty storage.local_dir")
    return RunFolder(store, storage.working_copy(local))


def _from_path(ckpt: Path, run: RunFolder, overwrite: bool, log: Log) -> Path:
    problem = verify_folder(ckpt, CHECKPOINT_FILES)
    if problem:
        raise CheckpointUnusable(f"trainer.resume_path={ckpt}: {problem}: not resuming from it")
    if ckpt.resolve().parent == (run.local / CHECKPOINTS).resolve():
        return ckpt  # an earlier checkpoint of this same run
    clear_or_refuse(run, "from_path", overwrite, log, resume_path=ckpt)
    step = int(read_trainer_state(ckpt)["step"])
    copy = run.local / CHECKPOINTS / step_folder(step)
    shutil.copytree(ckpt, copy)
    atomic_write(run.local / LATEST, f"{step}\n".encode())
    log(f"copied {ckpt} to {copy}")
    return copy


# ------------------------------------------------------------------------- S3 working copies


def _download_for_resume(run: RunFolder) -> None:
    """RESUME_FILES and eval results into the working copy (its checkpoint is there already),
    which then records all of it as uploaded."""
    held = storage.list_dir(run.store)
    names = [n for n in RESUME_FILES if n in held] + [f"eval/{n}" for n in
                                                      storage.list_dir(run.store, "eval")]
    storage.pull(run.store, names, run.local)


def mirror_run(local: Path, config: RunConfig) -> list[str]:
    """Upload what changed in the working copy `local` of an s3:// run_dir since the last call
    (nothing to do for a local run_dir): the files (metrics, eval results) first, then complete
    checkpoint and export folders whole (COMPLETE last), then the latest marker, so a checkpoint
    complete on S3 always has its step's metric rows beside it. Returns the keys uploaded."""
    store = storage.open_store(config.run_dir, config.storage.endpoint_url)
    return storage.mirror(store, Path(local), (CHECKPOINTS, EXPORTS), LATEST) if store.s3 else []
