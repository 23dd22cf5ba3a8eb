"""A real Ray head node (`ray start --head --block` on 127.0.0.1, its own temp dir, token auth
ON with a test token): training steps through a Ray Client connection, and runs submitted as
Ray Jobs (submit -> logs -> SUCCEEDED; a long job stopped -> STOPPED), all through the CLI.

Every client runs in a subprocess of its own (Ray allows one connection per process, and this
process may hold the local instance of test_ray_local.py). The clients get only RAY_AUTH_TOKEN:
`connect` / `job_client` switch RAY_AUTH_MODE=token on by themselves. The head is stopped by
signalling the one process that started it (`ray start --block` tears its node down).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from workbench.cluster.jobs import TERMINAL
from workbench.run import read_metrics

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="needs the ray extra (pip install 'workbench[ray]')")

RUN = ["trainer.total_steps=2", "trainer.ckpt_interval=1", "trainer.eval_interval=0",
       "trainer.hf_save_interval=0", "eval.n_mazes=2", "eval.sampled_passes=0",
       "trainer.resume_mode=none"]


@dataclass(frozen=True)
class Head:
    client_address: str  # ray://127.0.0.1:PORT
    dashboard: str  # http://127.0.0.1:PORT (Ray Jobs)
    client_env: dict  # what a client process gets: the token, no RAY_AUTH_MODE


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    """`ray start --head` on loopback with 2 CPUs and token auth; stopped at module end."""
    gcs, client, dashboard = _free_port(), _free_port(), _free_port()
    token = secrets.token_hex(16)
    bin_dir = str(Path(sys.executable).parent)  # the job's `python` is this venv's
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {
        "PATH": bin_dir + os.pathsep + os.environ["PATH"], "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0"}
    env = base | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
                  "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # every service on 127.0.0.1
    cmd = [str(Path(bin_dir) / "ray"), "start", "--head", "--block",
           "--node-ip-address=127.0.0.1", f"--port={gcs}", f"--ray-client-server-port={client}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dashboard}", "--num-cpus=2", "--disable-usage-stats",
           f"--temp-dir={tmp_path_factory.mktemp('head')}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    output = []
    for line in proc.stdout:  # ends at "block forever" (ready) or when ray start exits
        output.append(line)
        if "block forever" in line:
            break
    assert proc.poll() is None, "".join(output)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    try:
        yield Head(f"ray://127.0.0.1:{client}", f"http://127.0.0.1:{dashboard}",
                   base | {"RAY_AUTH_TOKEN": token})
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def _cli(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", *args], env=env, cwd="/",
                          capture_output=True, text=True, timeout=timeout)


def _overrides(small_run: list[str], model: str, run_dir: Path) -> list[str]:
    return small_run + RUN + [f"model.name={model}", f"run_dir={run_dir}"]


def test_training_steps_through_ray_client_with_a_token(head: Head, sft_model: str,
                                                        small_run: list[str],
                                                        tmp_path: Path) -> None:
    run_dir = tmp_path / "client"
    out = _cli(["train", *_overrides(small_run, sft_model, run_dir),
                f"cluster.address={head.client_address}"], head.client_env)
    assert out.returncode == 0, out.stderr[-3000:]
    [line] = [x for x in out.stdout.splitlines() if x.startswith("connected to")]
    assert f"the Ray cluster at {head.client_address}" in line and "auth token" in line, line
    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2] and sum(r["update/datums"] for r in rows) > 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["model"]["backend"]["kind"] == "ray"
    assert (run_dir / "checkpoints" / "global_step_2" / "COMPLETE").exists()


def test_submitted_job_streams_logs_and_succeeds(head: Head, sft_model: str,
                                                 small_run: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "job"
    out = _cli(["submit", "--address", head.dashboard, "--follow",
                *_overrides(small_run, sft_model, run_dir)], head.client_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    job_id = out.stdout.splitlines()[0].removeprefix("submitted ").strip()
    assert "step    2" in out.stdout and out.stdout.rstrip().endswith(f"{job_id}: SUCCEEDED")
    assert "cluster.address=auto" in out.stdout  # the job's actors ran on the cluster
    assert [r["step"] for r in read_metrics(run_dir) if "reward/mean" in r] == [1, 2]
    status = _cli(["status", job_id, "--address", head.dashboard], head.client_env)
    assert status.stdout.strip() == "SUCCEEDED", status.stderr
    logs = _cli(["logs", job_id, "--address", head.dashboard], head.client_env)
    assert "step    1" in logs.stdout and "eval step 2" in logs.stdout


def test_a_long_job_can_be_stopped(head: Head, sft_model: str, small_run: list[str],
                                   tmp_path: Path) -> None:
    run_dir = tmp_path / "long"
    overrides = _overrides(small_run, sft_model, run_dir) + [
        "trainer.total_steps=100000", "cluster.address="]  # trains inside the job's process
    out = _cli(["submit", "--address", head.dashboard, *overrides], head.client_env)
    assert out.returncode == 0, out.stderr[-3000:]
    job_id = out.stdout.splitlines()[0].removeprefix("submitted ").strip()
    deadline = time.monotonic() + 300
    while not any("reward/mean" in r for r in read_metrics(run_dir)) \
            and time.monotonic() < deadline:
        time.sleep(0.2)  # waiting for an event (the job's first step), not for time to pass
    assert any("reward/mean" in r for r in read_metrics(run_dir)), "the job never trained"
    stop = _cli(["stop", job_id, "--address", head.dashboard], head.client_env)
    assert stop.stdout.strip() == "stop requested", stop.stderr
    status = ""
    while status not in TERMINAL and time.monotonic() < deadline:
        status = _cli(["status", job_id, "--address", head.dashboard],
                      head.client_env).stdout.strip()
    assert status == "STOPPED"
