"""trainer.logger: TensorBoard, MLflow and W&B hold the scalars of metrics.jsonl, per step, read
back from their real local stores (TensorBoard's EventAccumulator, MLflow's client on the run
folder's SQLite file, W&B's own reader of an offline run's records), also across a resume that
redoes a step; bad values and missing extras fail in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from workbench import loggers
from workbench.config import PRESETS, ConfigError, apply_overrides, check_loggers
from workbench.run import append_metrics, read_metrics, truncate_metrics

ALL = "jsonl,tensorboard,mlflow,wandb"


def _expected(rows: list[dict]) -> dict[tuple[str, int], float]:
    """(key, step) -> value of every number in metrics.jsonl (rows of one step never share a
    key: training rows and evaluation rows have different ones)."""
    out: dict[tuple[str, int], float] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float):
                assert (key, row["step"]) not in out, (key, row["step"])
                out[key, row["step"]] = float(value)
    return out


def _tensorboard(folder: Path) -> dict[tuple[str, int], float]:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(folder), size_guidance={ea.SCALARS: 0})  # 0: keep every one
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def _float32(values: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    return {k: float(np.float32(v)) for k, v in values.items()}  # TensorBoard keeps float32


def test_a_bad_logger_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        apply_overrides(PRESETS["tiny"], ["trainer.logger=jsonl,tensorbord"])
    assert str(err.value) == (
        "trainer.logger='jsonl,tensorbord': 'tensorbord' is not one of ['jsonl', 'tensorboard',"
        " 'mlflow', 'wandb'] (did you mean 'tensorboard'?); give one or more, comma-separated, "
        "e.g. jsonl,tensorboard")
    with pytest.raises(ConfigError, match="trainer.logger='': '' is not one of"):
        apply_overrides(PRESETS["tiny"], ["trainer.logger="])
    config = apply_overrides(PRESETS["tiny"], ["trainer.logger=mlflow, tensorboard"])
    assert loggers.parse(config.trainer.logger) == ("jsonl", "tensorboard", "mlflow")
    assert loggers.parse(PRESETS["tiny"].trainer.logger) == ("jsonl",)  # the default


@pytest.mark.parametrize("module, extra", [("tensorboard", "tensorboard"), ("mlflow", "mlflow"),
                                           ("sqlalchemy", "mlflow"), ("wandb", "wandb")])
def test_a_missing_extra_is_named_before_the_run_folder_is_touched(
        module: str, extra: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from workbench.rl.train import start

    if module == "sqlalchemy":  # mlflow registers its SQL stores at import: import it whole first
        pytest.importorskip("mlflow")
    monkeypatch.setitem(sys.modules, module, None)  # `import module` fails as if not installed
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    config = apply_overrides(PRESETS["tiny"], [f"run_dir={run_dir}", f"trainer.logger={ALL}"])
    with pytest.raises(ConfigError) as err:
        start(config)
    assert str(err.value) == (
        f"trainer.logger='{ALL}': {module!r} is needed for this feature but is not installed: "
        f"pip install 'workbench[{extra}]' (or `make setup`)")
    assert not run_dir.exists()
    check_loggers("jsonl")  # metrics.jsonl alone needs nothing


def test_tensorboard_keeps_the_resumed_value_of_a_redone_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    for step in range(4):
        append_metrics(tmp_path, {"step": step, "reward/mean": step / 3, "ok": True}, "tensorboard")
    truncate_metrics(tmp_path, 1)  # a resume from step 1's checkpoint redoes 2 and 3
    for step in (2, 3):
        append_metrics(tmp_path, {"step": step, "reward/mean": -step / 7, "ok": False},
                       "jsonl,tensorboard")
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert _tensorboard(tmp_path / "tensorboard") == _float32(_expected(rows))


def test_a_logger_switched_on_later_starts_with_every_row(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    append_metrics(tmp_path, {"step": 0, "eval/greedy_success": 0.25})
    append_metrics(tmp_path, {"step": 1, "reward/mean": 0.5}, "jsonl,tensorboard")
    assert _tensorboard(tmp_path / "tensorboard") == {("eval/greedy_success", 0): 0.25,
                                                      ("reward/mean", 1): 0.5}


def _wandb_offline(run_dir: Path) -> tuple[dict[tuple[str, int], float], dict[str, Any]]:
    """((key, step) -> the last value logged, the run's config) from every offline folder of a
    W&B run, read with W&B's own reader of its run files."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    values: dict[tuple[str, int], float] = {}
    config: dict[str, Any] = {}
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        store = datastore.DataStore()
        store.open_for_scan(str(path))
        while (data := store.scan_data()) is not None:
            record = pb.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                         for i in record.history.item}
                values |= {(k, items["_step"]): v for k, v in items.items()
                           if not k.startswith(("_", "eval/mazes"))}
            elif record.WhichOneof("record_type") == "run":
                config |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
    return values, config


def test_every_logger_holds_the_metrics_jsonl_scalars_per_step(
        sft_model: str, small_run: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """One GRPO step after the step-0 checkpoint, then a resume that redoes it (as after a
    crash): every store ends up with the scalars of metrics.jsonl at every step; W&B, with no
    key here, logs offline and says so in one line."""
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    wandb = pytest.importorskip("wandb")
    from workbench.rl.train import train

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_API_KEY",
                 "WANDB_PROJECT", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no W&B key
    run_dir = tmp_path / "run"
    config = apply_overrides(PRESETS["tiny"], small_run + [
        f"model.name={sft_model}", f"run_dir={run_dir}", f"trainer.logger={ALL}",
        "trainer.total_steps=1", "trainer.ckpt_interval=2", "trainer.hf_save_interval=0",
        "trainer.keep_step_records=false", "eval.n_mazes=4", "eval.sampled_passes=0"])
    try:
        train(config, log=lambda _: None)
        first = read_metrics(run_dir)
        train(config, log=lambda _: None)  # resume_mode=latest: back to step 0, step 1 again
    finally:
        wandb.finish()  # W&B writes its run files as the run ends
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in first] == [0, 1, 1]  # eval, step, eval
    assert rows[1]["time/step"] != first[1]["time/step"]  # step 1 was redone
    expected = _expected(rows)
    assert {k for k, _ in expected} >= {"reward/mean", "update/loss", "eval/greedy_success"}

    assert _tensorboard(run_dir / "tensorboard") == _float32(expected)

    client = mlflow.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    saved = json.loads((run_dir / "mlflow_run.json").read_text())
    [run] = client.search_runs([saved["experiment_id"]])  # the resume went on in the same run
    assert run.info.run_id == saved["run_id"] and run.info.run_name == "run"
    assert run.data.params["trainer.logger"] == ALL
    latest: dict[tuple[str, int], float] = {}
    for key in run.data.metrics:
        history = sorted(client.get_metric_history(run.info.run_id, key),
                         key=lambda m: m.timestamp)
        latest |= {(key, m.step): m.value for m in history}  # the later value of a step wins
    assert latest == expected
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "reward/mean")]
    assert steps == [1, 1]  # the redone step holds both values

    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wandb:")]
    [folder] = run_dir.glob("wandb/offline-run-*")  # both starts in one process: one run
    assert said == [f"wandb: no API key ($WANDB_API_KEY or `wandb login`), so this run logs "
                    f"offline to {folder}; `wandb sync {folder}` uploads it"]
    values, wb_config = _wandb_offline(run_dir)
    assert values == expected  # the live run kept the redone step's later values
    assert wb_config["trainer"]["logger"] == ALL
    saved = json.loads((run_dir / "wandb_run.json").read_text())
    tables = sorted(run_dir.glob("wandb/offline-run-*/files/media/table/eval/mazes_*.json"))
    assert {t.name.split("_")[1] for t in tables} == {"0", "1"}  # the evaluations of steps 0, 1
    for path in tables:
        table = json.loads(path.read_text())
        assert table["columns"] == ["maze", "mode", "solved", "episodes"]
        assert [row[:2] for row in table["data"]] == [[k, "greedy"] for k in range(4)]
    assert saved["project"] == "workbench"


def test_wandb_goes_offline_without_a_key_or_a_server_and_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    assert loggers.wandb_mode() == ("offline", "no API key ($WANDB_API_KEY or `wandb login`)")
    (tmp_path / ".netrc").write_text("machine 127.0.0.1 login user password k\n")
    (tmp_path / ".netrc").chmod(0o600)  # as `wandb login` writes it (netrc refuses others')
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:1")  # a key, and nothing listens
    assert loggers.wandb_mode() == ("offline", "127.0.0.1 cannot be reached")
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the user's choice decides, silently
    assert loggers.wandb_mode() == ("disabled", "")
