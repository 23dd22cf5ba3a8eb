"""Checkpoints you can trust (runfolder.py, session/checkpoint.py), in a local run folder and
on an S3 prefix (moto's server) alike:

- every file of a checkpoint is recorded (sha256, size) in SHA256SUMS.json at write time and
  checked at load; each file of the newest checkpoint, damaged in each way (deleted, truncated,
  a flipped byte, replaced by garbage JSON), is reported in one exact line and the previous
  intact checkpoint is used;
- a run resumes past a damaged newest checkpoint and ends bit for bit as the undisturbed run;
- stray names under checkpoints/ are ignored; temporaries of interrupted writes are removed at
  the next start, in one line; checkpoints written before checksums are used with a note;
- load_state / load_adapter refuse a damaged folder in one line and change nothing.

The random `tiny` model keeps each run to seconds.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import moved, place_run, run_overrides
from safetensors.torch import load_file

from workbench import storage
from workbench.config import PRESETS, apply_overrides
from workbench.run import read_metrics
from workbench.runfolder import find_checkpoint, remove_temporaries
from workbench.session import IncompleteCheckpoint
from workbench.session.checkpoint import verify_folder
from workbench.storage import Store

RUN = ["trainer.total_steps=2", "trainer.ckpt_interval=1", "trainer.hf_save_interval=0",
       "trainer.eval_interval=0", "eval.n_mazes=2", "eval.sampled_passes=0",
       "generator.max_turns=3", "algorithm.learning_rate=1e-3"]


def _config(tiny_dir: Path, small_run: list[str], *extra: str):
    return apply_overrides(PRESETS["tiny"], small_run + RUN + [f"model.name={tiny_dir}", *extra])


@pytest.fixture(scope="module")
def run(tiny_dir: Path, small_run: list[str], tmp_path_factory: pytest.TempPathFactory):
    """A 2-step run with checkpoints at steps 0, 1 and 2 (its session stays open)."""
    from workbench.rl.train import train

    run_dir = tmp_path_factory.mktemp("ckpt-run")
    trainer = train(_config(tiny_dir, small_run, f"run_dir={run_dir}"), log=lambda *_: None)
    yield trainer
    trainer.session.close()


def _copy(run, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run.run_dir, copy)
    return copy


def _damaged(data: bytes, how: str) -> bytes:
    if how == "truncate":
        return data[:len(data) // 2]
    if how == "flip":
        middle = len(data) // 2
        return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
    return (b'{"garbage": [' * len(data))[:len(data)]  # garbage JSON of the same length


def _corrupt(path: Path, how: str) -> None:
    path.unlink() if how == "delete" else path.write_bytes(_damaged(path.read_bytes(), how))


def _damage(store: Store, key: str, how: str) -> bytes:
    """Damage the file at key (a local folder's or an S3 object); returns what it held."""
    data = storage.read_bytes(store, key)
    if how == "delete":
        storage.delete(store, key)
    else:
        storage.write_bytes(store, key, _damaged(data, how))
    return data


def _expected(rel: str, how: str, size: int) -> str:
    if rel == "COMPLETE":
        return ("incomplete (no COMPLETE marker: an interrupted write)" if how == "delete"
                else "COMPLETE is damaged (not a marker this code writes)")
    if rel == "SHA256SUMS.json":
        return ("SHA256SUMS.json is missing (COMPLETE records its sha256)" if how == "delete"
                else "SHA256SUMS.json is damaged (its sha256 differs from the one COMPLETE "
                     "records)")
    return {"delete": f"{rel} is missing",
            "truncate": f"{rel} is truncated ({size // 2} of {size} bytes)",
            "flip": f"{rel} is damaged (sha256 mismatch)",
            "garbage": f"{rel} is damaged (sha256 mismatch)"}[how]


def test_every_file_is_checksummed(run) -> None:
    folder = run.run_dir / "checkpoints" / "global_step_2"
    sums = json.loads((folder / "SHA256SUMS.json").read_text())["files"]
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert set(sums) == files - {"COMPLETE", "SHA256SUMS.json"}
    assert {"trainer_state.json", "state/adapter_model.safetensors", "state/optimizer.safetensors",
            "state/session.json", "state/SHA256SUMS.json", "state/COMPLETE"} <= set(sums)
    assert re.fullmatch(r"ok sha256=[0-9a-f]{64}\n", (folder / "COMPLETE").read_text())
    assert verify_folder(folder) == "" and verify_folder(folder / "state") == ""


def test_each_damage_to_each_file_falls_back_to_the_previous_checkpoint(run, store,
                                                                         tmp_path) -> None:
    newest = run.run_dir / "checkpoints" / "global_step_2"
    files = sorted(p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file())
    assert len(files) >= 9
    folder = place_run(run.run_dir, store, tmp_path)
    if store.s3:  # an upload keeps the manifest's sha256 in the marker, and adds its token
        marker = storage.read_bytes(store, "checkpoints/global_step_2/COMPLETE").decode()
        assert marker.startswith((newest / "COMPLETE").read_text().strip() + " upload=")
    failures = []
    for rel in files:
        for how in ("delete", "truncate", "flip", "garbage"):
            key = f"checkpoints/global_step_2/{rel}"
            data = _damage(store, key, how)
            lines: list[str] = []
            chosen = find_checkpoint(folder, lines.append)
            want = [f"skipping checkpoint global_step_2: {_expected(rel, how, len(data))}"]
            if chosen is None or chosen.name != "global_step_1" or lines != want:
                failures.append((rel, how, chosen and chosen.name, lines))
            storage.write_bytes(store, key, data)
    assert not failures, failures


def test_stray_folders_are_ignored(run, store, tmp_path) -> None:
    folder = place_run(run.run_dir, store, tmp_path)
    ckpts = run.run_dir / "checkpoints"
    storage.put_folder(store, "checkpoints/global_step_4_backup", ckpts / "global_step_2")
    storage.put_folder(store, "checkpoints/global_step_x", ckpts / "global_step_1")
    storage.write_bytes(store, "checkpoints/global_step_/notes.txt", b"")
    storage.write_bytes(store, "checkpoints/.global_step_3.tmp-abc123/trainer_state.json", b"{")
    lines: list[str] = []
    assert find_checkpoint(folder, lines.append) == folder.local / "checkpoints/global_step_2"
    assert lines == [f"ignoring checkpoints/{name}: not a global_step_<N> checkpoint folder"
                     for name in ("global_step_", "global_step_4_backup", "global_step_x")]


def test_temporaries_of_interrupted_writes_are_removed(run, tmp_path) -> None:
    run_dir = _copy(run, tmp_path)
    ckpts = run_dir / "checkpoints"
    (ckpts / ".global_step_3.tmp-abc123").mkdir()
    (ckpts / ".global_step_3.tmp-abc123" / "trainer_state.json").write_text("{")
    (run_dir / "exports" / ".global_step_3.tmp-def456").mkdir(parents=True)
    (run_dir / ".state-tmp").mkdir()
    lines: list[str] = []
    removed = remove_temporaries(run_dir, lines.append)
    assert removed == [".state-tmp", "checkpoints/.global_step_3.tmp-abc123",
                       "exports/.global_step_3.tmp-def456"]
    assert lines == [f"removed what interrupted writes left in {run_dir}: "
                     ".state-tmp, checkpoints/.global_step_3.tmp-abc123, "
                     "exports/.global_step_3.tmp-def456"]
    assert not any(run_dir.glob("**/*.tmp-*")) and not (run_dir / ".state-tmp").exists()
    assert remove_temporaries(run_dir, lines.append) == [] and len(lines) == 1


def test_checkpoints_from_before_checksums_are_used_with_a_note(run, store, tmp_path) -> None:
    run_dir = _copy(run, tmp_path)
    for folder in (run_dir / "checkpoints").glob("global_step_*"):
        for sub in (folder, folder / "state"):
            (sub / "SHA256SUMS.json").unlink()
            (sub / "COMPLETE").write_text("ok\n")  # the marker before checksums
    folder = place_run(run_dir, store, tmp_path)
    lines: list[str] = []
    assert find_checkpoint(folder, lines.append).name == "global_step_2"
    assert lines == ["checkpoint global_step_2 has no SHA256SUMS.json (written before "
                     "checksums): only its JSON and safetensors structure were checked"]
    size = len(_damage(store, "checkpoints/global_step_2/state/adapter_model.safetensors",
                       "truncate"))
    _damage(store, "checkpoints/global_step_1/trainer_state.json", "garbage")
    lines.clear()
    assert find_checkpoint(folder, lines.append).name == "global_step_0"
    assert lines == [
        "skipping checkpoint global_step_2: state/adapter_model.safetensors is truncated "
        f"({size // 2} of {size} bytes)",
        "skipping checkpoint global_step_1: trainer_state.json is damaged (not valid JSON)",
        "checkpoint global_step_0 has no SHA256SUMS.json (written before checksums): only its "
        "JSON and safetensors structure were checked"]


def test_resume_past_a_damaged_newest_checkpoint_is_bit_exact(run, store, tiny_dir, small_run,
                                                              tmp_path) -> None:
    from workbench.rl.train import train

    folder = place_run(run.run_dir, store, tmp_path)
    run_dir = folder.local
    _damage(store, "checkpoints/global_step_2/state/adapter_model.safetensors", "flip")
    if not store.s3:  # a write killed half-way (what a working copy leaves is not uploaded)
        (run_dir / "checkpoints" / ".global_step_3.tmp-k9").mkdir()
    lines: list[str] = []
    trainer = train(_config(tiny_dir, small_run, *run_overrides(store, tmp_path)), lines.append)
    trainer.session.close()
    assert lines[:4] == [
        "skipping checkpoint global_step_2: state/adapter_model.safetensors is damaged "
        "(sha256 mismatch)",
        f"run directory {store.root} (working copy {run_dir})" if store.s3 else
        f"removed what interrupted writes left in {run_dir}: checkpoints/.global_step_3.tmp-k9",
        f"resuming with changed settings: {moved(run.run_dir, store, tmp_path)}; config.json "
        "updated",  # the copy lives elsewhere
        f"resumed from {run_dir / 'checkpoints' / 'global_step_1'} at step 1"]
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
                          for r in rows]
    assert strip(read_metrics(run_dir)) == strip(read_metrics(run.run_dir))
    for name in ("state/adapter_model.safetensors", "state/optimizer.safetensors"):
        a = load_file(str(run.run_dir / "checkpoints/global_step_2" / name))
        b = load_file(str(run_dir / "checkpoints/global_step_2" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = lambda d: json.loads((d / "checkpoints/global_step_2/trainer_state.json")  # noqa
                                 .read_text())
    assert state(run_dir)["rng"] == state(run.run_dir)["rng"]
    assert verify_folder(run_dir / "checkpoints/global_step_2") == ""


def test_load_state_and_load_adapter_refuse_a_damaged_folder(run, tmp_path) -> None:
    tc = run.training_client
    state = tmp_path / "state"
    shutil.copytree(run.run_dir / "checkpoints/global_step_1/state", state)
    _corrupt(state / "optimizer.safetensors", "flip")
    before = {n: p.detach().clone() for n, p in run.session.host.trainable().items()}
    with pytest.raises(IncompleteCheckpoint) as info:
        tc.load_state(state).result()
    assert str(info.value) == (f"{state}: optimizer.safetensors is damaged (sha256 mismatch): "
                               "not loading it")
    adapter = Path(tc.export(tmp_path / "adapter", "adapter").result())
    assert verify_folder(adapter) == ""
    size = (adapter / "adapter_config.json").stat().st_size
    _corrupt(adapter / "adapter_config.json", "truncate")
    with pytest.raises(IncompleteCheckpoint) as info:
        tc.load_adapter(adapter).result()
    assert str(info.value) == (f"adapter {adapter}: adapter_config.json is truncated "
                               f"({size // 2} of {size} bytes): not loading it")
    after = run.session.host.trainable()
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing was touched
