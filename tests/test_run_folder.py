"""Nothing deleted unasked, resume only with the same config, intervals exactly as documented,
in a local run folder and on an S3 prefix (moto's server) alike:

- trainer.resume_mode=none on a run folder that holds anything is refused, naming the folder,
  what it holds and trainer.overwrite; with trainer.overwrite=true one line says what is
  removed. The same for resume_mode=latest with no intact checkpoint, for from_path into
  another run's folder and for `sft` (sft.overwrite);
- resuming with a config that differs from the checkpoint's outside the allow-list is refused,
  naming each key old -> new; an allowed change is logged in one line and config.json updated;
- trainer.ckpt_interval / hf_save_interval / eval_interval: N and 0 as config.py documents.

The random `tiny` model keeps each run to seconds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import moved, place_run, run_folder, run_overrides

from workbench import storage
from workbench.config import PRESETS, apply_overrides, to_dict
from workbench.rl.train import start, train
from workbench.run import read_metrics
from workbench.runfolder import (
    RESUMABLE,
    CheckpointUnusable,
    ResumeConfigChanged,
    RunFolder,
    RunFolderExists,
)
from workbench.session.checkpoint import verify_folder, write_checksums
from workbench.storage import Store

RUN = ["trainer.total_steps=2", "trainer.ckpt_interval=1", "trainer.hf_save_interval=0",
       "trainer.eval_interval=0", "eval.n_mazes=2", "eval.sampled_passes=0",
       "generator.max_turns=3", "algorithm.learning_rate=1e-3"]
HELD = ("3 checkpoints, 2 eval results, 2 step records, metrics.jsonl (4 rows), config.json, "
        "latest_checkpointed_iteration.txt, manifest.json, session_spec.json")
"""What the 2-step run's folder holds, as the messages list it."""


def _config(tiny_dir: Path, small_run: list[str], run_dir: Path | str, *extra: str):
    return apply_overrides(PRESETS["tiny"], small_run + RUN + [
        f"model.name={tiny_dir}", f"run_dir={run_dir}", *extra])


def _at(tiny_dir: Path, small_run: list[str], run: RunFolder, tmp_path: Path, *extra: str):
    """The config of a run at `run` (a local folder, or an S3 prefix through tmp_path/wc)."""
    return apply_overrides(PRESETS["tiny"], small_run + RUN + [
        f"model.name={tiny_dir}", *run_overrides(run.store, tmp_path), *extra])


def _quiet(*_: object) -> None:
    pass


def _opening(lines: list[str]) -> list[str]:
    """The lines of a start without the one naming an S3 run's working copy."""
    return [line for line in lines if not line.startswith("run directory s3://")]


@pytest.fixture(scope="module")
def first(tiny_dir: Path, small_run: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run (checkpoints 0, 1, 2)."""
    run_dir = tmp_path_factory.mktemp("first")
    train(_config(tiny_dir, small_run, run_dir), log=_quiet).session.close()
    return run_dir


def _copy_of(first: Path, folder: Path, *where: str) -> Path:
    """A copy of the first run in `folder`, as if trained with the overrides `where` (run_dir
    and storage.*: its configs say so)."""
    shutil.copytree(first, folder)
    at = to_dict(apply_overrides(PRESETS["tiny"], list(where)))
    placed = {"run_dir": at["run_dir"], "storage": at["storage"]}
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | placed))
    for ckpt in (folder / "checkpoints").iterdir():
        state = json.loads((ckpt / "trainer_state.json").read_text())
        state["config"] |= placed
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
        (ckpt / "COMPLETE").write_text(f"ok sha256={write_checksums(ckpt)}\n")
    return folder


@pytest.fixture
def copy(first: Path, store: Store, tmp_path: Path) -> RunFolder:
    """The first run at `store` (a local folder or an S3 prefix), as if trained there."""
    return place_run(_copy_of(first, tmp_path / "copy", *run_overrides(store, tmp_path)), store,
                     tmp_path)


@pytest.fixture
def where(store: Store, tmp_path: Path) -> RunFolder:
    """An empty run_dir: a local folder or an S3 prefix."""
    return run_folder(store, tmp_path)


def _snapshot(store: Store) -> dict[str, bytes]:
    return {name: storage.read_bytes(store, name) for name in storage.list_files(store)}


# ------------------------------------------------------------------ nothing deleted unasked


def test_resume_mode_none_refuses_a_run_folder_and_deletes_nothing(copy, tiny_dir, small_run,
                                                                   tmp_path) -> None:
    before = _snapshot(copy.store)
    with pytest.raises(RunFolderExists) as info:
        start(_at(tiny_dir, small_run, copy, tmp_path, "trainer.resume_mode=none"), log=_quiet)
    assert str(info.value) == (
        f"run_dir {copy.where} is not empty ({HELD}) and trainer.resume_mode=none starts a new "
        "run there, which would delete it: add trainer.overwrite=true to remove it, or choose "
        "another run_dir (trainer.resume_mode=latest continues it)")
    assert _snapshot(copy.store) == before


def test_overwrite_says_what_it_removes_then_starts_over(copy, tiny_dir, small_run,
                                                         tmp_path) -> None:
    lines: list[str] = []
    config = _at(tiny_dir, small_run, copy, tmp_path, "trainer.resume_mode=none",
                 "trainer.overwrite=true", "trainer.total_steps=1")
    train(config, log=lines.append).session.close()
    assert lines[0] == f"trainer.overwrite=true: removing {copy.where}: {HELD}"
    assert storage.list_dir(copy.store, "checkpoints") == ["global_step_0", "global_step_1"]
    assert [r["step"] for r in read_metrics(copy.local)] == [0, 1, 1]


def test_latest_without_an_intact_checkpoint_is_refused(copy, tiny_dir, small_run,
                                                        tmp_path) -> None:
    storage.delete(copy.store, "checkpoints")
    held = ("2 eval results, 2 step records, metrics.jsonl (4 rows), "
            "latest_checkpointed_iteration.txt")  # config.json, manifest.json: a start's first
    with pytest.raises(RunFolderExists) as info:
        start(_at(tiny_dir, small_run, copy, tmp_path), log=_quiet)
    assert str(info.value) == (
        f"run_dir {copy.where} holds a run ({held}) but no intact checkpoint to resume from "
        "(trainer.resume_mode=latest): add trainer.overwrite=true to remove it and start over, "
        "or choose another run_dir")
    lines: list[str] = []
    trainer = start(_at(tiny_dir, small_run, copy, tmp_path, "trainer.overwrite=true"),
                    lines.append)
    trainer.session.close()
    assert lines == [f"trainer.overwrite=true: removing {copy.where}: {held}"] + (
        [f"run directory {copy.where} (working copy {copy.local})"] if copy.store.s3 else [])
    assert trainer.step == 0 and storage.folder_complete(copy.store, "checkpoints/global_step_0")


def test_latest_starts_fresh_over_what_a_start_writes_first(where, tiny_dir, small_run,
                                                            tmp_path) -> None:
    """A run killed before its step-0 checkpoint left config.json and manifest.json only."""
    storage.write_bytes(where.store, "config.json", b"{}")
    storage.write_bytes(where.store, "manifest.json", b"{}")
    lines: list[str] = []
    trainer = start(_at(tiny_dir, small_run, where, tmp_path), lines.append)
    trainer.session.close()
    assert _opening(lines) == [] and trainer.step == 0
    assert storage.read_json(where.store, "config.json")["run_dir"] == where.where


def test_from_path_into_another_folder(first, where, tiny_dir, small_run, tmp_path) -> None:
    ckpt = first / "checkpoints" / "global_step_1"
    storage.write_bytes(where.store, "notes.txt", b"mine")
    path = ["trainer.resume_mode=from_path", f"trainer.resume_path={ckpt}"]
    with pytest.raises(RunFolderExists) as info:
        start(_at(tiny_dir, small_run, where, tmp_path, *path), log=_quiet)
    assert str(info.value) == (
        f"run_dir {where.where} is not empty (notes.txt) and is not the run of "
        f"trainer.resume_path={ckpt}: add trainer.overwrite=true to remove it, or choose another "
        "run_dir")
    storage.delete(where.store, "notes.txt")
    lines: list[str] = []
    trainer = start(_at(tiny_dir, small_run, where, tmp_path, *path), lines.append)
    trainer.session.close()
    copied = where.local / "checkpoints" / "global_step_1"
    assert _opening(lines) == [f"copied {ckpt} to {copied}",
                               "resuming with changed settings: "
                               f"{moved(first, where.store, tmp_path)}; config.json updated",
                               f"resumed from {copied} at step 1"]
    assert trainer.step == 1 and (where.local / "config.json").is_file()


def test_from_path_refuses_a_damaged_checkpoint_in_one_line(first, where, tiny_dir, small_run,
                                                            tmp_path) -> None:
    ckpt = tmp_path / "global_step_1"
    shutil.copytree(first / "checkpoints" / "global_step_1", ckpt)
    (ckpt / "state" / "session.json").unlink()
    with pytest.raises(CheckpointUnusable) as info:
        start(_at(tiny_dir, small_run, where, tmp_path, "trainer.resume_mode=from_path",
                  f"trainer.resume_path={ckpt}"), log=_quiet)
    assert str(info.value) == (f"trainer.resume_path={ckpt}: state/session.json is missing: "
                               "not resuming from it")
    assert storage.list_files(where.store) == []
    assert where.store.s3 or not where.local.exists()  # nothing made (an S3 working copy: empty)


def test_sft_refuses_a_run_folder_unless_sft_overwrite(tiny_dir, small_run, tmp_path) -> None:
    from workbench.rl.sft import run_sft

    run_dir = tmp_path / "sft"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    sft = ["sft.steps=1", "sft.batch_size=1", "generator.max_turns=3"]
    with pytest.raises(RunFolderExists) as info:
        run_sft(_config(tiny_dir, small_run, run_dir, *sft), log=_quiet)
    assert str(info.value) == (
        f"run_dir {run_dir} is not empty (metrics.jsonl (2 rows), model) and sft would delete "
        "it: add sft.overwrite=true to remove it, or choose another run_dir")
    assert (run_dir / "metrics.jsonl").is_file()
    lines: list[str] = []
    model = run_sft(_config(tiny_dir, small_run, run_dir, *sft, "sft.overwrite=true"),
                    log=lines.append)
    assert lines[0] == f"sft.overwrite=true: removing {run_dir}: metrics.jsonl (2 rows), model"
    assert verify_folder(model) == "" and len(read_metrics(run_dir)) == 1


def test_the_cli_refuses_in_one_line(first, tiny_dir, small_run, tmp_path) -> None:
    copy = _copy_of(first, tmp_path / "run", f"run_dir={tmp_path / 'run'}")
    args = small_run + RUN + [f"model.name={tiny_dir}", f"run_dir={copy}",
                              "trainer.resume_mode=none"]
    done = subprocess.run([sys.executable, "-m", "workbench", "train", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 4, done.stderr
    assert done.stderr.splitlines() == [
        f"error: run_dir {copy} is not empty ({HELD}) and trainer.resume_mode=none starts a new "
        "run there, which would delete it: add trainer.overwrite=true to remove it, or choose "
        "another run_dir (trainer.resume_mode=latest continues it)"]


# ------------------------------------------------------------------ resume and the config


def test_resume_refuses_a_changed_config_naming_each_key(copy, tiny_dir, small_run,
                                                         tmp_path) -> None:
    before = _snapshot(copy.store)
    config = _at(tiny_dir, small_run, copy, tmp_path, "algorithm.learning_rate=3e-4",
                 "lora.rank=8", "trainer.total_steps=3")
    with pytest.raises(ResumeConfigChanged) as info:
        start(config, log=_quiet)
    assert str(info.value) == (
        f"cannot resume from {copy.local / 'checkpoints' / 'global_step_2'} with another config: "
        "algorithm.learning_rate 0.001 -> 0.0003, lora.rank 4 -> 8. Only "
        f"{', '.join(RESUMABLE)} may change on resume. Start a new run with another run_dir, "
        "or start this one over with trainer.resume_mode=none trainer.overwrite=true (which "
        "deletes it)")
    assert _snapshot(copy.store) == before  # config.json too


def test_resume_with_allowed_changes_logs_them_and_updates_config_json(copy, tiny_dir,
                                                                       small_run,
                                                                       tmp_path) -> None:
    lines: list[str] = []
    config = _at(tiny_dir, small_run, copy, tmp_path, "trainer.total_steps=3", "eval.n_mazes=3",
                 "trainer.eval_interval=5", "trainer.resume_mode=latest")
    trainer = train(config, log=lines.append)
    trainer.session.close()
    assert _opening(lines)[:2] == [
        "resuming with changed settings: eval.n_mazes 2 -> 3, trainer.eval_interval 0 -> 5, "
        "trainer.total_steps 2 -> 3; config.json updated",
        f"resumed from {copy.local / 'checkpoints' / 'global_step_2'} at step 2"]
    saved = storage.read_json(copy.store, "config.json")
    assert (saved["trainer"]["total_steps"], saved["eval"]["n_mazes"]) == (3, 3)
    assert trainer.step == 3 and read_metrics(copy.local)[-1]["eval/n_mazes"] == 3


# ------------------------------------------------------------------ intervals


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _eval_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "eval/n_mazes" in r]


def test_intervals_of_n(tiny_dir, small_run, tmp_path) -> None:
    """N = 2 over 3 steps: checkpoints 0 and 2 (not the last step 3: not a multiple), exports
    2 and 3 (the last), evaluations 0, 2 and 3 (the last)."""
    config = _config(tiny_dir, small_run, tmp_path, "trainer.total_steps=3",
                     "trainer.ckpt_interval=2", "trainer.hf_save_interval=2",
                     "trainer.eval_interval=2")
    train(config, log=_quiet).session.close()
    assert _names(tmp_path / "checkpoints") == ["global_step_0", "global_step_2"]
    assert _names(tmp_path / "exports") == ["global_step_2", "global_step_3"]
    assert _eval_steps(tmp_path) == [0, 2, 3]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2\n"


def test_intervals_of_zero_mean_never(tiny_dir, small_run, tmp_path) -> None:
    """0: no checkpoint at all (not even step 0), no export (not even the last step),
    evaluations only at step 0 and after the last step."""
    config = _config(tiny_dir, small_run, tmp_path, "trainer.ckpt_interval=0",
                     "trainer.hf_save_interval=0", "trainer.eval_interval=0")
    train(config, log=_quiet).session.close()
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "exports").exists()
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()
    assert _eval_steps(tmp_path) == [0, 2]
