"""Metric rows where users already look: TensorBoard, MLflow and Weights & Biases, beside
metrics.jsonl.

    python -m workbench train trainer.logger=jsonl,tensorboard,mlflow,wandb
    tensorboard --logdir runs/grpo/tensorboard
    mlflow ui --backend-store-uri sqlite:///runs/grpo/mlflow.db   # the UI needs the full `mlflow`
    wandb sync runs/grpo/wandb/offline-run-*                      # an offline run, uploaded

`trainer.logger` is a comma-separated list of LOGGERS. metrics.jsonl is always written (plots,
viewers and resume read it); every other logger gets each row's numbers (int, float, bool; not
`step`) under the same keys, at the row's step. A TensorBoard or MLflow write opens, appends
and closes, as metrics.jsonl does, so nothing is held open between steps:

- tensorboard: <run_dir>/tensorboard/events.out.tfevents.workbench, one event per row with a
  float32 scalar per key (TensorBoard's own record format, written with its protobufs).
- mlflow: one MLflow run per run folder, its id in <run_dir>/mlflow_run.json; the store is
  $MLFLOW_TRACKING_URI, else the SQLite file <run_dir>/mlflow.db (MLflow 3 refuses its plain
  file store). The flattened config is logged once as the run's params.
- wandb: one W&B run per run folder (project $WANDB_PROJECT, else "workbench"; named after the
  folder; its id in <run_dir>/wandb_run.json; its files under <run_dir>/wandb/), the config as
  the run's config, each evaluation's per-maze outcomes as a `wandb.Table` (`eval/mazes`). The
  run stays open in the process (wandb's own `wandb.run`) and ends with it. It runs offline
  when there is no API key ($WANDB_API_KEY or `wandb login`) or the server cannot be reached,
  and says so in one line; $WANDB_MODE, when set, decides instead.

Resuming from a checkpoint drops the metrics.jsonl rows after it and redoes those steps. The
TensorBoard file then gets a restart marker (SessionLog START at the first redone step), so
TensorBoard drops the older values of those steps, as after a TensorFlow restart; the MLflow and
W&B runs go on under the same id, so a redone step holds two values in its history and the later
one is the resumed run's (W&B keeps a step's values merged while the process lives; a resume in
a new process starts a new offline folder of the same run). A logger whose record is missing
(switched on at a resume, or a run resumed from s3:// on a new machine) first copies every row
of metrics.jsonl into it.
"""

from __future__ import annotations

import difflib
import json
import netrc
import numbers
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from workbench.deps import require

LOGGERS = ("jsonl", "tensorboard", "mlflow", "wandb")
"""The values trainer.logger may list."""

NEEDS = {"tensorboard": ("tensorboard",), "mlflow": ("mlflow", "sqlalchemy", "alembic"),
         "wandb": ("wandb",)}
"""Modules each logger imports (the mlflow extra brings SQLAlchemy and Alembic for the local
SQLite store; a tracking server set by $MLFLOW_TRACKING_URI needs only mlflow)."""

TB_FILE = Path("tensorboard") / "events.out.tfevents.workbench"
MLFLOW_RUN = "mlflow_run.json"
WANDB_RUN = "wandb_run.json"


def parse(spec: str) -> tuple[str, ...]:
    """The loggers a trainer.logger value names, in LOGGERS order (jsonl always included);
    ValueError naming the unknown one, the choices and the syntax."""
    names = [n.strip() for n in spec.split(",")]
    for name in names:
        if name not in LOGGERS:
            close = difflib.get_close_matches(name, LOGGERS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{name!r} is not one of {list(LOGGERS)}{hint}; give one or more, "
                             "comma-separated, e.g. jsonl,tensorboard")
    return tuple(n for n in LOGGERS if n in names or n == "jsonl")


def needed_modules(name: str) -> tuple[str, ...]:
    """The modules logger `name` imports (none for jsonl)."""
    if name == "mlflow" and os.environ.get("MLFLOW_TRACKING_URI"):
        return ("mlflow",)  # a tracking server: no local SQLite store
    return NEEDS.get(name, ())


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers (bools as 0/1) under their metrics.jsonl keys; `step` is the x axis."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, numbers.Real)}


def log_row(run_dir: Path, row: dict[str, Any], spec: str) -> None:
    """Give a metrics row (already appended to metrics.jsonl) to the other chosen loggers."""
    for name in parse(spec):
        if name in WRITERS:
            WRITERS[name](Path(run_dir), row)


def restart(run_dir: Path, first_step: int) -> None:
    """A resumed run redoes steps >= first_step: mark the TensorBoard file (when there is one
    and tensorboard imports), so TensorBoard drops those steps' older values."""
    path = Path(run_dir) / TB_FILE
    if not path.is_file():
        return
    try:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    except ImportError:
        return  # the file was written where tensorboard was installed; not here
    _tb_append(path, [Event(wall_time=time.time(), step=first_step,
                            session_log=SessionLog(status=SessionLog.START))])


# ------------------------------------------------------------------------- TensorBoard


def _write_tensorboard(run_dir: Path, row: dict[str, Any]) -> None:
    require("tensorboard")
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from tensorboard.compat.proto.summary_pb2 import Summary

    path, now = run_dir / TB_FILE, time.time()
    new = not path.is_file()
    rows = _history(run_dir, row) if new else [row]  # a new file: every row so far
    events = [Event(wall_time=now, file_version="brain.Event:2"),  # then a START that a later
              Event(wall_time=now, step=rows[0]["step"],  # restart marker pairs with
                    session_log=SessionLog(status=SessionLog.START))] if new else []
    for r in rows:
        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars(r).items()]
        events.append(Event(wall_time=now, step=r["step"], summary=Summary(value=values)))
    _tb_append(path, events)


def _tb_append(path: Path, events: list[Any]) -> None:
    from tensorboard.summary.writer.record_writer import RecordWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        writer = RecordWriter(f)
        for event in events:
            writer.write(event.SerializeToString())


# ------------------------------------------------------------------------- MLflow


def _write_mlflow(run_dir: Path, row: dict[str, Any]) -> None:
    require("mlflow")
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    uri = os.environ.get("MLFLOW_TRACKING_URI") or None  # None: this run folder's mlflow.db
    client = MlflowClient(uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    saved = _read_json(run_dir / MLFLOW_RUN)
    if saved.get("tracking_uri") == uri and saved.get("run_id"):
        run_id, rows = saved["run_id"], [row]
    else:  # a new run: every row so far
        run_id, rows = _new_mlflow_run(client, run_dir, uri), _history(run_dir, row)
    ms = int(time.time() * 1000)
    metrics = [Metric(k, v, ms, r["step"]) for r in rows for k, v in scalars(r).items()]
    for chunk in _chunks(metrics, 1000):  # MLflow's batch limit
        client.log_batch(run_id, metrics=chunk)


def _new_mlflow_run(client: Any, run_dir: Path, uri: str | None) -> str:
    """A run named after the run folder in experiment $MLFLOW_EXPERIMENT_NAME (else
    "workbench"), the flattened config.json as params; its id goes to mlflow_run.json."""
    from mlflow.entities import Param

    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "workbench"
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(
        name, artifact_location=None if uri else (run_dir / "mlartifacts").resolve().as_uri())
    run = client.create_run(experiment_id, run_name=run_dir.resolve().name,
                            tags={"workbench.run_dir": str(run_dir.resolve())})
    params = [Param(k, str(v)) for k, v in _flat(_read_json(run_dir / "config.json"))]
    for chunk in _chunks(params, 100):  # MLflow's batch limit for params
        client.log_batch(run.info.run_id, params=chunk)
    (run_dir / MLFLOW_RUN).write_text(json.dumps(
        {"tracking_uri": uri, "experiment_id": experiment_id, "run_id": run.info.run_id}))
    return run.info.run_id



# ------------------------------------------------------------------------- Weights & Biases


def _write_wandb(run_dir: Path, row: dict[str, Any]) -> None:
    run, rows = _wandb_run(run_dir, row)
    for r in rows:
        run.log(scalars(r) | _eval_table(run_dir, r), step=r["step"])


def _wandb_run(run_dir: Path, row: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """The run folder's W&B run and the rows to log: this process's live run when it is the
    folder's (the row alone); else a run resumed by the id in wandb_run.json (the row alone) or
    a new one (every row so far), with the config, offline as wandb_mode says."""
    wandb = require("wandb")
    saved = _read_json(run_dir / WANDB_RUN)
    if wandb.run is not None and wandb.run.id == saved.get("run_id"):
        return wandb.run, [row]
    if wandb.run is not None:
        wandb.run.finish()  # another run folder's, earlier in this process (a notebook)
    mode, why = wandb_mode()
    run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "workbench",
                     name=run_dir.resolve().name, id=saved.get("run_id"), resume="allow",
                     dir=run_dir, mode=mode, config=_read_json(run_dir / "config.json"),
                     settings=wandb.Settings(silent=True, console="off"))
    if why:
        print(f"wandb: {why}, so this run logs offline to {Path(run.dir).parent}; "
              f"`wandb sync {Path(run.dir).parent}` uploads it", flush=True)
    if saved.get("run_id") == run.id:
        return run, [row]
    (run_dir / WANDB_RUN).write_text(json.dumps({"run_id": run.id, "project": run.project}))
    return run, _history(run_dir, row)


def wandb_mode() -> tuple[str, str]:
    """(mode for wandb.init, why it is offline or ""): $WANDB_MODE when set; else "offline"
    without an API key ($WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc) or when the server
    ($WANDB_BASE_URL, else api.wandb.ai) does not answer a connection within 3 s."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], ""
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host = url.hostname or "api.wandb.ai"
    if not os.environ.get("WANDB_API_KEY") and not _netrc_key(host):
        return "offline", "no API key ($WANDB_API_KEY or `wandb login`)"
    try:
        socket.create_connection((host, url.port or 443), timeout=3).close()
    except OSError:
        return "offline", f"{host} cannot be reached"
    return "online", ""


def _netrc_key(host: str) -> bool:
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _eval_table(run_dir: Path, row: dict[str, Any]) -> dict[str, Any]:
    """{"eval/mazes": a wandb.Table of the evaluation's per-maze outcomes} for an evaluation
    row (eval/step_N.json written), else {}."""
    path = run_dir / "eval" / f"step_{row['step']:06d}.json"
    if "eval/n_mazes" not in row or not path.is_file():
        return {}
    import wandb

    data = [[k, r["mode"], solved, r["episodes_per_maze"]]
            for r in _read_json(path)["results"] for k, solved in enumerate(r["successes_P"])]
    return {"eval/mazes": wandb.Table(columns=["maze", "mode", "solved", "episodes"],
                                      data=data)}


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All metric rows (an unfinished last line from a killed writer is ignored)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows

# ------------------------------------------------------------------------- helpers


def _history(run_dir: Path, row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every metrics.jsonl row up to and including `row` (a new record starts complete)."""
    return read_metrics(run_dir) or [row]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _flat(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


WRITERS: dict[str, Callable[[Path, dict[str, Any]], None]] = {
    "tensorboard": _write_tensorboard, "mlflow": _write_mlflow, "wandb": _write_wandb}
"""The loggers besides metrics.jsonl (written by workbench.run.append_metrics)."""
