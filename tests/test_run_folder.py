"""Nothing deleted unasked, resume only with the same config, intervals exactly as documented:

- trainer.resume_mode=none on a run folder that holds anything is refused, naming the folder,
  what it holds and trainer.overwrite; with trainer.overwrite=true one line says what is
  removed. The same for resume_mode=latest with no intact checkpoint, for from_path into
  another run's folder, for `sft` (sft.overwrite) and for an s3:// prefix;
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

from workbench import storage
from workbench.config import PRESETS, apply_overrides
from workbench.rl.checkpoints import RESUMABLE, CheckpointUnusable, ResumeConfigChanged
from workbench.rl.train import start, train
from workbench.run import read_metrics
from workbench.session.checkpoint import atomic_folder, verify_folder, write_checksums
from workbench.storage import RunFolderExists

RUN = ["trainer.total_steps=2", "trainer.ckpt_interval=1", "trainer.hf_save_interval=0",
       "trainer.eval_interval=0", "eval.n_mazes=2", "eval.sampled_passes=0",
       "generator.max_turns=3", "algorithm.learning_rate=1e-3"]
HELD = ("3 checkpoints, 2 eval results, 2 step records, metrics.jsonl (4 rows), config.json, "
        "latest_checkpointed_iteration.txt, manifest.json, session_spec.json")
"""What the 2-step run's folder holds, as the messages list it."""


def _config(tiny_dir: Path, small_run: list[str], run_dir: Path | str, *extra: str):
    return apply_overrides(PRESETS["tiny"], small_run + RUN + [
        f"model.name={tiny_dir}", f"run_dir={run_dir}", *extra])


def _quiet(*_: object) -> None:
    pass


@pytest.fixture(scope="module")
def first(tiny_dir: Path, small_run: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run (checkpoints 0, 1, 2)."""
    run_dir = tmp_path_factory.mktemp("first")
    train(_config(tiny_dir, small_run, run_dir), log=_quiet).session.close()
    return run_dir


@pytest.fixture
def copy(first: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(first, run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps(config | {"run_dir": str(run_dir)}))
    for ckpt in (run_dir / "checkpoints").iterdir():  # as if trained here (run_dir unchanged)
        state = json.loads((ckpt / "trainer_state.json").read_text())
        state["config"]["run_dir"] = str(run_dir)
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
        (ckpt / "COMPLETE").write_text(f"ok sha256={write_checksums(ckpt)}\n")
    return run_dir


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ nothing deleted unasked


def test_resume_mode_none_refuses_a_run_folder_and_deletes_nothing(copy, tiny_dir,
                                                                   small_run) -> None:
    before = _snapshot(copy)
    with pytest.raises(RunFolderExists) as info:
        start(_config(tiny_dir, small_run, copy, "trainer.resume_mode=none"), log=_quiet)
    assert str(info.value) == (
        f"run_dir {copy} is not empty ({HELD}) and trainer.resume_mode=none starts a new run "
        "there, which would delete it: add trainer.overwrite=true to remove it, or choose "
        "another run_dir (trainer.resume_mode=latest continues it)")
    assert _snapshot(copy) == before


def test_overwrite_says_what_it_removes_then_starts_over(copy, tiny_dir, small_run) -> None:
    lines: list[str] = []
    config = _config(tiny_dir, small_run, copy, "trainer.resume_mode=none",
                     "trainer.overwrite=true", "trainer.total_steps=1")
    train(config, log=lines.append).session.close()
    assert lines[0] == f"trainer.overwrite=true: removing {copy}: {HELD}"
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == [
        "global_step_0", "global_step_1"]
    assert [r["step"] for r in read_metrics(copy)] == [0, 1, 1]


def test_latest_without_an_intact_checkpoint_is_refused(copy, tiny_dir, small_run) -> None:
    shutil.rmtree(copy / "checkpoints")
    held = ("2 eval results, 2 step records, metrics.jsonl (4 rows), "
            "latest_checkpointed_iteration.txt")  # config.json, manifest.json: a start's first
    with pytest.raises(RunFolderExists) as info:
        start(_config(tiny_dir, small_run, copy), log=_quiet)
    assert str(info.value) == (
        f"run_dir {copy} holds a run ({held}) but no intact checkpoint to resume from "
        "(trainer.resume_mode=latest): add trainer.overwrite=true to remove it and start over, "
        "or choose another run_dir")
    lines: list[str] = []
    trainer = start(_config(tiny_dir, small_run, copy, "trainer.overwrite=true"), lines.append)
    trainer.session.close()
    assert lines == [f"trainer.overwrite=true: removing {copy}: {held}"]
    assert trainer.step == 0 and (copy / "checkpoints" / "global_step_0" / "COMPLETE").is_file()


def test_latest_starts_fresh_over_what_a_start_writes_first(tiny_dir, small_run,
                                                            tmp_path) -> None:
    """A run killed before its step-0 checkpoint left config.json and manifest.json only."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text("{}")
    (run_dir / "manifest.json").write_text("{}")
    lines: list[str] = []
    trainer = start(_config(tiny_dir, small_run, run_dir), lines.append)
    trainer.session.close()
    assert lines == [] and trainer.step == 0
    assert json.loads((run_dir / "config.json").read_text())["run_dir"] == str(run_dir)


def test_from_path_into_another_folder(copy, tiny_dir, small_run, tmp_path) -> None:
    ckpt = copy / "checkpoints" / "global_step_1"
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    path = ["trainer.resume_mode=from_path", f"trainer.resume_path={ckpt}"]
    with pytest.raises(RunFolderExists) as info:
        start(_config(tiny_dir, small_run, other, *path), log=_quiet)
    assert str(info.value) == (
        f"run_dir {other} is not empty (notes.txt) and is not the run of trainer.resume_path="
        f"{ckpt}: add trainer.overwrite=true to remove it, or choose another run_dir")
    (other / "notes.txt").unlink()
    lines: list[str] = []
    trainer = start(_config(tiny_dir, small_run, other, *path), lines.append)
    trainer.session.close()
    assert lines == [f"copied {ckpt} to {other / 'checkpoints' / 'global_step_1'}",
                     f'resuming with changed settings: run_dir "{copy}" -> "{other}"; '
                     "config.json updated",
                     f"resumed from {other / 'checkpoints' / 'global_step_1'} at step 1"]
    assert trainer.step == 1 and (other / "config.json").is_file()


def test_from_path_refuses_a_damaged_checkpoint_in_one_line(copy, tiny_dir, small_run,
                                                            tmp_path) -> None:
    ckpt = copy / "checkpoints" / "global_step_1"
    (ckpt / "state" / "session.json").unlink()
    with pytest.raises(CheckpointUnusable) as info:
        start(_config(tiny_dir, small_run, tmp_path / "new", "trainer.resume_mode=from_path",
                      f"trainer.resume_path={ckpt}"), log=_quiet)
    assert str(info.value) == (f"trainer.resume_path={ckpt}: state/session.json is missing: "
                               "not resuming from it")
    assert not (tmp_path / "new").exists()


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


def test_the_cli_refuses_in_one_line(copy, tiny_dir, small_run) -> None:
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


def test_resume_refuses_a_changed_config_naming_each_key(copy, tiny_dir, small_run) -> None:
    before = _snapshot(copy)
    config = _config(tiny_dir, small_run, copy, "algorithm.learning_rate=3e-4", "lora.rank=8",
                     "trainer.total_steps=3")
    with pytest.raises(ResumeConfigChanged) as info:
        start(config, log=_quiet)
    assert str(info.value) == (
        f"cannot resume from {copy / 'checkpoints' / 'global_step_2'} with another config: "
        "lora.rank 4 -> 8, algorithm.learning_rate 0.001 -> 0.0003. Only "
        f"{', '.join(RESUMABLE)} may change on resume. Start a new run with another run_dir, "
        "or start this one over with trainer.resume_mode=none trainer.overwrite=true (which "
        "deletes it)")
    assert _snapshot(copy) == before  # config.json too


def test_resume_with_allowed_changes_logs_them_and_updates_config_json(copy, tiny_dir,
                                                                       small_run) -> None:
    lines: list[str] = []
    config = _config(tiny_dir, small_run, copy, "trainer.total_steps=3", "eval.n_mazes=3",
                     "trainer.eval_interval=5", "trainer.resume_mode=latest")
    trainer = train(config, log=lines.append)
    trainer.session.close()
    assert lines[:2] == [
        "resuming with changed settings: eval.n_mazes 2 -> 3, trainer.eval_interval 0 -> 5, "
        "trainer.total_steps 2 -> 3; config.json updated",
        f"resumed from {copy / 'checkpoints' / 'global_step_2'} at step 2"]
    saved = json.loads((copy / "config.json").read_text())
    assert (saved["trainer"]["total_steps"], saved["eval"]["n_mazes"]) == (3, 3)
    assert trainer.step == 3 and read_metrics(copy)[-1]["eval/n_mazes"] == 3


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


# ------------------------------------------------------------------ S3 prefixes


def _checkpoint_like(root: Path, step: int) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "state").mkdir()
        (tmp / "state" / "weights.bin").write_bytes(bytes(range(256)) * (step + 1))
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
    return atomic_folder(root / f"global_step_{step}", write)


def test_s3_prefix_is_not_cleared_unasked(s3_server, s3_bucket, tmp_path) -> None:
    run_dir = f"{s3_bucket}/runs/a"
    store = storage.open_store(run_dir, s3_server)
    storage.put_folder(store, "checkpoints/global_step_0", _checkpoint_like(tmp_path / "c", 0))
    storage.write_bytes(store, "metrics.jsonl", b'{"step": 0}\n{"step": 1}\n')
    storage.write_json(store, "config.json", {})
    wc = str(tmp_path / "wc")
    with pytest.raises(RunFolderExists) as info:
        storage.open_run_dir(run_dir, "none", s3_server, wc, log=_quiet)
    held = "1 checkpoint, metrics.jsonl (2 rows), config.json"
    assert str(info.value) == (
        f"run_dir {run_dir} is not empty ({held}) and trainer.resume_mode=none starts a new run "
        "there, which would delete it: add trainer.overwrite=true to remove it, or choose "
        "another run_dir (trainer.resume_mode=latest continues it)")
    assert storage.list_dir(store) == ["checkpoints", "config.json", "metrics.jsonl"]
    lines: list[str] = []
    local = storage.open_run_dir(run_dir, "none", s3_server, wc, lines.append, overwrite=True)
    assert lines == [f"trainer.overwrite=true: removing {run_dir}: {held}",
                     f"run directory {run_dir} (working copy {wc})"]
    assert storage.list_dir(store) == [] and storage.run_contents(storage.open_store(local)) == ""


def test_s3_resume_skips_a_damaged_checkpoint(s3_server, s3_bucket, tmp_path) -> None:
    store = storage.open_store(f"{s3_bucket}/runs/b", s3_server)
    for step in (1, 2):
        storage.put_folder(store, f"checkpoints/global_step_{step}",
                           _checkpoint_like(tmp_path / "c", step))
    storage.put_folder(store, "checkpoints/global_step_9_old", _checkpoint_like(tmp_path / "d", 9))
    marker = storage.read_bytes(store, "checkpoints/global_step_2/COMPLETE").decode()
    local_marker = (tmp_path / "c" / "global_step_2" / "COMPLETE").read_text().strip()
    assert marker.startswith(local_marker + " upload=")  # the manifest's sha256 survives upload
    storage.write_bytes(store, "checkpoints/global_step_2/state/weights.bin", b"\0" * 768)
    lines: list[str] = []
    newest = storage.fetch_run(store, tmp_path / "wc", lines.append)
    assert newest == tmp_path / "wc" / "checkpoints" / "global_step_1"
    assert verify_folder(newest) == ""
    assert lines == [
        f"skipping checkpoint global_step_2 on {store.root}: state/weights.bin is damaged "
        "(sha256 mismatch)",
        f"downloaded checkpoint global_step_1 from {store.root}"]
    assert not (tmp_path / "wc" / "checkpoints" / "global_step_2").exists()
