"""Storage over a local folder and over S3 (moto's server on loopback, reached by endpoint_url):

- a folder goes up and comes back byte for byte, with its COMPLETE marker written last;
- a torn upload (no marker, or an overwrite that died half-way) is refused, never half-read;
- AWS_ENDPOINT_URL is honoured when no endpoint is configured;
- a training run with run_dir=s3://... mirrors checkpoints, exports, eval results and metrics
  there after each step (an export there publishes straight to the registry, with its step's
  eval results), and a later run resumes from S3 alone (the newest complete checkpoint,
  skipping a torn one) into a fresh working copy;
- credentials appear in no error message, repr, traceback, manifest or config.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
from conftest import S3_KEY_ID, S3_SECRET

from workbench import registry, storage
from workbench.config import PRESETS, apply_overrides
from workbench.rl.train import train
from workbench.run import read_metrics
from workbench.runfolder import LATEST


def _folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.json").write_text('{"x": 1}')
    (src / "sub" / "b.bin").write_bytes(bytes(range(256)) * 40)
    (src / storage.COMPLETE).write_text("ok\n")
    return src


def test_folder_round_trip(store: storage.Store, tmp_path: Path) -> None:
    src = _folder(tmp_path)
    storage.put_folder(store, "runs/x/ckpt", src)
    assert storage.list_dir(store, "runs/x") == ["ckpt"]
    assert storage.list_dir(store, "runs/x/ckpt") == ["COMPLETE", "a.json", "sub"]
    assert storage.exists(store, "runs/x/ckpt/a.json")
    assert not storage.exists(store, "runs/x/ckpt/missing.json")
    back = storage.get_folder(store, "runs/x/ckpt", tmp_path / "back")
    files = lambda d: {p.relative_to(d).as_posix(): p.read_bytes()  # noqa: E731
                       for p in d.rglob("*") if p.is_file() and p.name != storage.COMPLETE}
    assert files(back) == files(src) and (back / storage.COMPLETE).is_file()
    storage.write_json(store, "meta/info.json", {"k": [1, 2]})
    assert storage.read_json(store, "meta/info.json") == {"k": [1, 2]}
    with pytest.raises(FileNotFoundError):
        storage.read_json(store, "meta/none.json")
    storage.delete(store, "runs")
    assert storage.list_dir(store, "runs") == []


def test_torn_uploads_are_refused(store: storage.Store, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    src = _folder(tmp_path)
    # 1. files without a marker (an upload killed before its end)
    storage.put_file(store, "torn/a.json", src / "a.json")
    with pytest.raises(storage.IncompleteUpload, match="no COMPLETE marker"):
        storage.get_folder(store, "torn", tmp_path / "out1")
    assert not (tmp_path / "out1").exists()
    # 2. an overwrite that dies half-way: the old marker is gone before the first new file
    storage.put_folder(store, "over", src)
    real_put, calls = storage.put_file, []

    def failing_put(*args: object) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise storage.StorageError("connection lost (simulated)")
        real_put(*args)

    monkeypatch.setattr(storage, "put_file", failing_put)
    with pytest.raises(storage.StorageError, match="simulated"):
        storage.put_folder(store, "over", src)
    monkeypatch.undo()
    assert not storage.folder_complete(store, "over")
    with pytest.raises(storage.IncompleteUpload):
        storage.get_folder(store, "over", tmp_path / "out2")
    # 3. a local folder that is not complete is not uploaded at all
    (src / storage.COMPLETE).unlink()
    with pytest.raises(storage.IncompleteUpload, match="not uploading"):
        storage.put_folder(store, "never", src)
    assert storage.list_dir(store, "never") == []


def test_endpoint_url_from_the_environment(s3_server: str, s3_bucket: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    store = storage.open_store(f"{s3_bucket}/env")  # no endpoint_url: boto3 reads the variable
    storage.write_json(store, "x.json", [1])
    assert storage.read_json(storage.open_store(f"{s3_bucket}/env", s3_server), "x.json") == [1]


RUN = ["trainer.total_steps=2", "trainer.ckpt_interval=1", "trainer.hf_save_interval=1",
       "trainer.eval_interval=0", "eval.n_mazes=2", "eval.sampled_passes=0",
       "generator.max_turns=3", "algorithm.learning_rate=1e-3"]


def _secret_free(text: str) -> None:
    assert S3_KEY_ID not in text and S3_SECRET not in text


def test_run_dir_on_s3_is_mirrored_and_resumed_from_s3(
        s3_server: str, s3_bucket: str, tiny_dir: Path, small_run: list[str],
        tmp_path: Path) -> None:
    run_dir = f"{s3_bucket}/runs/a"
    base = small_run + RUN + [f"model.name={tiny_dir}", f"run_dir={run_dir}",
                              f"storage.endpoint_url={s3_server}"]
    config = apply_overrides(PRESETS["tiny"], base + [f"storage.local_dir={tmp_path / 'wc1'}",
                                                      "trainer.resume_mode=none"])
    train(config, log=lambda *_: None)
    store = storage.open_store(run_dir, s3_server)
    assert storage.list_dir(store) == ["checkpoints", "config.json", "eval", "exports",
                                       LATEST, "manifest.json", "metrics.jsonl",
                                       "session_spec.json", "steps"]
    assert storage.list_dir(store, "checkpoints") == [f"global_step_{s}" for s in (0, 1, 2)]
    assert all(storage.folder_complete(store, f"checkpoints/global_step_{s}") for s in (0, 1, 2))
    assert storage.list_dir(store, "exports") == ["global_step_1", "global_step_2"]
    assert storage.read_bytes(store, LATEST).decode().strip() == "2"
    first = read_metrics(tmp_path / "wc1")
    assert storage.read_bytes(store, "metrics.jsonl") == \
        (tmp_path / "wc1" / "metrics.jsonl").read_bytes()
    for name in ("manifest.json", "config.json"):  # nothing secret went into them
        _secret_free(storage.read_bytes(store, name).decode())
    entry = registry.publish(storage.open_store(f"{s3_bucket}/wb", s3_server),
                             f"{run_dir}/exports/global_step_2", "from-s3")  # S3 -> registry
    assert (entry.run, entry.step, entry.eval["greedy"]["n_mazes"]) == (run_dir, 2, 2)

    # A torn checkpoint on S3 (files without COMPLETE) above the newest one is skipped.
    storage.write_bytes(store, "checkpoints/global_step_9/trainer_state.json", b"{}")
    logs: list[str] = []
    resumed = apply_overrides(PRESETS["tiny"], base + ["trainer.total_steps=3",
                                                       f"storage.local_dir={tmp_path / 'wc2'}"])
    trainer = train(resumed, log=logs.append)
    assert "skipping checkpoint global_step_9: incomplete (no COMPLETE marker" in " ".join(logs)
    assert any(line.startswith("resumed from") and "global_step_2" in line for line in logs)
    assert trainer.step == 3 and trainer.run_dir == tmp_path / "wc2"
    rows = read_metrics(tmp_path / "wc2")
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
                        for r in rs]
    assert strip(rows[:len(first)]) == strip(first) and rows[-1]["step"] == 3
    assert "global_step_3" in storage.list_dir(store, "checkpoints")
    assert json.loads(storage.read_bytes(store, "metrics.jsonl").decode().splitlines()[-1])[
        "step"] == 3


def test_credentials_appear_in_no_error_repr_or_traceback(s3_server: str, s3_bucket: str,
                                                          tmp_path: Path) -> None:
    failures = [
        lambda: storage.read_json(storage.open_store("s3://no-such-bucket-wb/p", s3_server), "x"),
        lambda: storage.put_folder(storage.open_store("s3://no-such-bucket-wb/p", s3_server),
                                   "f", _folder(tmp_path)),
        lambda: storage.list_dir(storage.open_store(f"{s3_bucket}/p", "http://127.0.0.1:9"), ""),
    ]
    for fail in failures:
        with pytest.raises((storage.StorageError, FileNotFoundError)) as info:
            fail()
        text = "".join(traceback.format_exception(info.value)) + repr(info.value)
        assert "s3://" in str(info.value)  # it says what failed
        _secret_free(text)
    store = storage.open_store(f"{s3_bucket}/p", f"http://{S3_KEY_ID}:{S3_SECRET}@127.0.0.1:9")
    _secret_free(repr(store))
    _secret_free(storage.redact(f"key {S3_KEY_ID} secret {S3_SECRET}"))
