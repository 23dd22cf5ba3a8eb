"""A real Ray head node (`ray start --head --block` on 127.0.0.1, its own temp dir, token auth
ON with a test token): training steps through a Ray Client connection, and runs submitted as
Ray Jobs (submit -> logs -> SUCCEEDED; a long job stopped -> STOPPED), all through the CLI.
Faults: a SIGKILLed driver resumes on the cluster (trainer.resume_mode=latest) and ends as the
uninterrupted run; a head torn down under a running driver gives one clear error (rc 3) and
leaves a complete checkpoint that resumes.

Every client runs in a subprocess of its own (Ray allows one connection per process, and this
process may hold the local instance of test_ray_local.py). The clients get only RAY_AUTH_TOKEN:
`connect` / `job_client` switch RAY_AUTH_MODE=token on by themselves. The head runs in a process
group of its own, and is stopped by SIGKILL to that group: every Ray process goes at once (a
SIGTERM to `ray start --block` took ~30 s to tear the node down).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from workbench.jobs import TERMINAL
from workbench.run import read_metrics
from workbench.serve.deploy import free_port

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


def _start_head(temp_dir: Path) -> tuple[subprocess.Popen, Head]:
    """`ray start --head --block` on loopback with 2 CPUs and token auth (the process, the head)."""
    gcs, client, dashboard = free_port(), free_port(), free_port()
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
           f"--temp-dir={temp_dir}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    output = []
    for line in proc.stdout:  # ends at "block forever" (ready) or when ray start exits
        output.append(line)
        if "block forever" in line:
            break
    assert proc.poll() is None, "".join(output)
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, Head(f"ray://127.0.0.1:{client}", f"http://127.0.0.1:{dashboard}",
                      base | {"RAY_AUTH_TOKEN": token})


def _stop_head(proc: subprocess.Popen) -> None:
    """SIGKILL the head's process group (`ray start --block` and every Ray process it started):
    the node vanishes at once, as a lost machine does."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=120)


@pytest.fixture(scope="module")
def head(ray_temp_dir: Path) -> Iterator[Head]:
    """A head node for the module's tests; stopped at module end."""
    proc, head = _start_head(ray_temp_dir)
    try:
        yield head
    finally:
        _stop_head(proc)


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


def _wait_for_checkpoint(run_dir: Path, step: int, driver: subprocess.Popen) -> None:
    """Until checkpoint `step` is complete (an event), or the driver ended without it."""
    done = run_dir / "checkpoints" / f"global_step_{step}" / "COMPLETE"
    deadline = time.monotonic() + 300
    while not done.exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.exists(), f"no checkpoint {step} (driver rc {driver.poll()})"


def _steps(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")}
            for r in read_metrics(run_dir)]


def test_a_killed_driver_resumes_on_the_cluster_with_resume_mode_latest(
        head: Head, sft_model: str, small_run: list[str], tmp_path: Path) -> None:
    """SIGKILL the driver of a Ray Client run after its first checkpoint; re-running the same
    command with trainer.resume_mode=latest ends with exactly the uninterrupted run's metrics."""
    run_dir, reference = tmp_path / "driver", tmp_path / "reference"
    args = ["train", *_overrides(small_run, sft_model, run_dir), "trainer.total_steps=3",
            f"cluster.address={head.client_address}"]
    env = head.client_env | {"RAY_CLIENT_RECONNECT_GRACE_PERIOD": "5"}  # frees its actors soon
    driver = subprocess.Popen([sys.executable, "-m", "workbench", *args], env=env, cwd="/",
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_checkpoint(run_dir, 1, driver)
    driver.kill()
    driver.wait()
    resumed = _cli([*args, "trainer.resume_mode=latest"], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout, resumed.stdout
    uninterrupted = _cli(["train", *_overrides(small_run, sft_model, reference),
                          "trainer.total_steps=3", "cluster.address="], env)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert [r["step"] for r in _steps(run_dir) if "reward/mean" in r] == [1, 2, 3]
    assert _steps(run_dir) == _steps(reference)


def test_a_vanished_cluster_gives_a_clear_error_and_keeps_the_checkpoints(
        sft_model: str, small_run: list[str], tmp_path: Path, another_ray_temp_dir: Path) -> None:
    """Tear a head node down under a running Ray Client driver: it exits with rc 3 and one
    message naming the cluster, the newest complete checkpoint and the command that goes on;
    that checkpoint resumes (in-process)."""
    proc, lost = _start_head(another_ray_temp_dir)
    run_dir = tmp_path / "run"
    args = ["train", *_overrides(small_run, sft_model, run_dir), "trainer.total_steps=100000",
            f"cluster.address={lost.client_address}"]
    env = lost.client_env | {"RAY_CLIENT_RECONNECT_GRACE_PERIOD": "3"}  # gives up after 3 s
    driver = subprocess.Popen([sys.executable, "-m", "workbench", *args], env=env, cwd="/",
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_checkpoint(run_dir, 1, driver)
    finally:
        _stop_head(proc)
    _, stderr = driver.communicate(timeout=300)
    assert driver.returncode == 3, stderr[-3000:]
    [line] = [x for x in stderr.splitlines() if x.startswith("connection error: lost the Ray")]
    assert f"lost the Ray cluster at {lost.client_address} after step" in line, line
    assert "trainer.resume_mode=latest" in line, line
    kept_path, kept_step = re.search(r"newest complete checkpoint: (\S+) \(step (\d+)\)",
                                     line).groups()
    kept, step = Path(kept_path), int(kept_step)
    assert step >= 1 and (kept / "COMPLETE").exists(), line
    goes_on = _cli([*args[:-2], f"trainer.total_steps={step + 1}", "trainer.resume_mode=latest",
                    "cluster.address="], env)
    assert goes_on.returncode == 0, goes_on.stderr[-3000:]
    assert f"resumed from {kept} at step {step}" in goes_on.stdout, goes_on.stdout
    assert [r["step"] for r in read_metrics(run_dir) if "reward/mean" in r] == list(
        range(1, step + 2))
