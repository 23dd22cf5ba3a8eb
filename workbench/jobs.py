"""Training runs as Ray Jobs: submit, follow the logs, status, stop (Ray's JobSubmissionClient).

    python -m workbench submit --address http://127.0.0.1:8265 --follow trainer.total_steps=40
    python -m workbench status raysubmit_XXXX   |   stop raysubmit_XXXX   |   logs raysubmit_XXXX

From a notebook cell:

    job_id = submit_run(["trainer.total_steps=40"], address="http://127.0.0.1:8265")
    follow_logs(job_id, address)      # prints the job's output as it arrives; returns its status

The job runs `python -m workbench train <overrides>` on the cluster, with this project as its
working directory (runtime_env working_dir; files ignored by .gitignore, such as .venv and runs/,
or by .git/info/exclude are not uploaded) and `cluster.address=auto`, so the run's actors go on
that cluster. run_dir (and model.name when it is a local folder) are made absolute, so the job
writes the run directory this machine reads - the same folder when the cluster runs here or
shares the filesystem, and a notebook can plot metrics.jsonl while the job runs.
"""

from __future__ import annotations

import asyncio
import shlex
import threading
import uuid
from pathlib import Path
from typing import Any

from workbench.cluster.connect import prepare_environment
from workbench.config import PRESETS, apply_overrides
from workbench.deps import require
from workbench.storage import open_store

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")  # a job in one of these will not change again


def job_client(address: str | None = None) -> Any:
    """A JobSubmissionClient for the dashboard at `address` (None: RAY_ADDRESS, else the
    cluster running on this machine); token auth is used when a token is there."""
    prepare_environment(loopback=False)
    require("ray")
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def project_root() -> Path | None:
    """The folder holding pyproject.toml next to the workbench package (an editable install or
    a checkout); None for an installed wheel (the cluster then needs workbench installed)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else None


def local_excludes(root: Path) -> list[str]:
    """The patterns of `<root>/.git/info/exclude`: files git ignores on this machine only (Ray's
    upload reads .gitignore, not this file), so they are not uploaded with the job either."""
    exclude = root / ".git" / "info" / "exclude"
    if not exclude.is_file():
        return []
    lines = (line.strip() for line in exclude.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def job_overrides(overrides: list[str], preset: str = "tiny") -> list[str]:
    """The overrides with run_dir (and a local model folder) absolute, and cluster.address=auto
    unless given. Validates them here, before anything is submitted."""
    config = apply_overrides(PRESETS[preset], overrides)
    fixed = {"run_dir": open_store(config.run_dir).root}  # a folder made absolute, or s3://
    if Path(config.model.name).exists():
        fixed["model.name"] = str(Path(config.model.name).resolve())
    keep = [o for o in overrides if o.split("=", 1)[0].strip().removeprefix("--") not in fixed]
    auto = [] if any(o.strip().startswith("cluster.address=") for o in overrides) \
        else ["cluster.address=auto"]
    return keep + [f"{k}={v}" for k, v in fixed.items()] + auto


def submit_run(overrides: list[str], address: str | None = None, preset: str = "tiny",
               env_vars: dict[str, str] | None = None,
               working_dir: str | Path | None = None) -> str:
    """Submit `python -m workbench train <overrides>` as a Ray Job; returns the job id."""
    args = job_overrides(overrides, preset)
    entrypoint = shlex.join(["python", "-m", "workbench", "train", "--preset", preset, *args])
    root = working_dir or project_root()
    runtime_env: dict[str, Any] = {"env_vars": dict(env_vars or {})}
    if root is not None:
        runtime_env["working_dir"] = str(root)  # .gitignore'd files are not uploaded
        runtime_env["excludes"] = local_excludes(Path(root))  # nor .git/info/exclude'd ones
    run_dir = next(a for a in reversed(args) if a.startswith("run_dir=")).split("=", 1)[1]
    return job_client(address).submit_job(
        entrypoint=entrypoint, runtime_env=runtime_env,
        submission_id=f"workbench-{Path(run_dir).name}-{uuid.uuid4().hex[:8]}",
        metadata={"run_dir": run_dir, "workbench": "train"})


def job_status(job_id: str, address: str | None = None) -> str:
    """PENDING | RUNNING | SUCCEEDED | FAILED | STOPPED."""
    return str(job_client(address).get_job_status(job_id).value)


def stop_job(job_id: str, address: str | None = None) -> bool:
    """Ask the cluster to stop the job (SIGTERM, then SIGKILL); True if it was running."""
    return bool(job_client(address).stop_job(job_id))


def job_logs(job_id: str, address: str | None = None) -> str:
    """Everything the job has printed so far."""
    return str(job_client(address).get_job_logs(job_id))


def follow_logs(job_id: str, address: str | None = None, out: Any = None) -> str:
    """Print the job's output as it arrives until the job ends; returns its final status.

    Runs Ray's async log tail on a thread of its own, so it works in a notebook cell (whose
    event loop is already running) as in a terminal."""
    client = job_client(address)
    write = out or (lambda text: print(text, end="", flush=True))
    errors: list[BaseException] = []

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            write(chunk)

    def run() -> None:
        try:
            asyncio.run(tail())
        except BaseException as err:  # re-raised on the caller's thread
            errors.append(err)

    thread = threading.Thread(target=run, name=f"logs-{job_id}", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return str(client.get_job_status(job_id).value)
