"""Every GPU path in one command: `make test-gpu` (one call, a 575 s budget on one H200).

    make test-gpu                                     # CUDA, vllm and ray importable
    python -m benchmarks.gpu_paths --list             # the paths, without running them
    python -m benchmarks.gpu_paths --only inprocess/vllm-merged --no-pytest

Each path is `python -m workbench train` as a user runs it, twice in one run folder: two GRPO
steps and a checkpoint, then `trainer.resume_mode=latest` for one more step and the evaluation
after it.

- On the tiny Qwen3-VL in bf16, each sampler mode on each executor:
  - the modes: our engine (`engine.name=transformers`, CUDA graphs), vLLM with adapters, vLLM
    with merged versions, vLLM merged in FP8 (`engine.vllm_fp8`), and `speed.fp8_base` (the
    update's frozen base in FP8, vLLM merged);
  - the executors: in-process; Ray started by the run (`cluster.address=local`); a driver
    outside a `ray start --head` over `ray://` (the notebook's way in). The head advertises
    five GPUs over the one card, with Ray's CUDA_VISIBLE_DEVICES left alone, so the client
    paths of different modes run side by side.
- The seed_gpu preset at the 8B shape (random weights, `algorithm.advantage=parity`, full
  15-turn episodes): on Ray (one trainer, one vLLM engine, colocated on the GPU) for two steps,
  a checkpoint and an evaluation; then in-process, resumed from that step-2 checkpoint, for two
  more (steps 3-4) and an evaluation. Each start's first step pays the compilations, so each
  8B row times one step (2 on Ray, 4 in-process). On a GPU of less than 120 GB (an 80 GB
  H100) they are left out, with one line that says so; `--only` runs them alone.
- The CUDA-only tests: `pytest -m gpu`.

A random model earns the same reward in every episode, so every path trains with
`algorithm.advantage=parity` (+-1 by episode index: every step updates). The paths run in lanes
side by side (two a mode, one for the 8B shape, one for the tests; the 8B lane first on the CPU,
the others at nice 10). A path passes when both
starts exit 0, its metrics hold every step with an update, the checkpoint and the evaluation are
written, the resume says so, and no fast path it asked for fell back (`speed/*` 0.0).

One table at the end, a row per path: pass or the first error line, the median step time (the
steps after the first of each start), the sampler/trainer KL, the peak GPU memory the run logged
(`memory/gpu_peak_gb`: torch's peak in each of its processes plus vLLM's budget) and, for the
8B rows, the phases. --out keeps each run's folder, its log and `table.md` / `results.json`.

Answers: Does every GPU path still run, and at what step time, KL and memory? Figures:
benchmarks/RESULTS.md, "Every GPU path (`make test-gpu`)".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.loggers import read_metrics

ROOT = Path(__file__).resolve().parent.parent
CLIENT_PORT = 10001  # Ray Client's port on the head the ray:// paths connect to
HEAD_GPUS = 5  # GPUs the head advertises over the one card: a client path of each mode at once

TINY = ["model.name=tiny", "trainer.train_batch_size=4", "generator.n_samples_per_prompt=4",
        "generator.max_turns=6", "generator.max_tokens=4", "algorithm.advantage=parity",
        "algorithm.minibatch=8", "eval.n_mazes=4", "eval.sampled_passes=0",
        "trainer.eval_interval=0", "trainer.hf_save_interval=0",
        "engine.gpu_memory_utilization=0.04", "engine.vllm_kv_cache_gb=0.25"]
"""The tiny paths' settings over the tiny preset: 4 mazes x 4 episodes of 6 turns, vLLM in 4% of
the GPU with a KV cache of 0.25 GiB set directly (its start-up measure of the GPU's free memory
fails while other paths' processes come and go); on the GPU in bf16 (vLLM's LoRA kernels take
bf16), float32 on a CPU (--device cpu, our engine only: the runner's own test)."""

MODES: dict[str, list[str]] = {
    "ours": ["engine.name=transformers", "engine.cuda_graphs=true"],
    "vllm-adapter": ["engine.name=vllm", "engine.vllm_lora=adapter"],
    "vllm-merged": ["engine.name=vllm", "engine.vllm_lora=merged"],
    "vllm-merged-fp8": ["engine.name=vllm", "engine.vllm_lora=merged", "engine.vllm_fp8=true",
                        "algorithm.tis_cap=2"],
    "fp8-base": ["engine.name=vllm", "engine.vllm_lora=merged", "speed.fp8_base=true",
                 "algorithm.tis_cap=2"],
}

EXECUTORS: dict[str, list[str]] = {
    "inprocess": [],
    "ray": ["cluster.address=local", "cluster.num_cpus=4"],
    "ray-client": [f"cluster.address=ray://127.0.0.1:{CLIENT_PORT}"],
}

EIGHT_B_ROOM_GB = 120.0
"""GPU memory the 8B rows need beside the tiny paths and the tests: they peaked at 116.5 GB on an
H200 (benchmarks/RESULTS.md, "Every GPU path"), and ran out of memory on an 80 GB H100."""

SEED_8B = ["engine.vllm_kv_cache_gb=20", "generator.temperature=1.0", "generator.max_tokens=8",
           "algorithm.advantage=parity", "eval.n_mazes=8", "eval.sampled_passes=0",
           "trainer.eval_interval=0", "trainer.hf_save_interval=0",
           "trainer.keep_step_records=false"]
"""The 8B rows' settings over seed_gpu: the GPU benchmark's (benchmarks/gpu.py) replies of 8
tokens at temperature 1 and the parity advantage; 8 greedy evaluation mazes; vLLM's KV cache
set directly to 20 GiB (about what its 0.3 share leaves it at this shape), as for the tiny
paths."""

PHASES = ("time/rollout", "time/update", "time/weight_sync")
GPU_TEST_FILES = ["tests/test_gpu_paths.py", "tests/test_cluster.py", "tests/test_fp8.py",
                  "tests/test_vllm_engine.py", "tests/test_serve_vllm.py",
                  "tests/test_serve_parity.py"]
"""The test modules that hold the `gpu` marker's tests (tests/conftest.py): collected alone, as
the others need packages a GPU image may not have (nbformat, moto, ...)."""


@dataclass
class Path_:
    """One path: its starts (argument lists of `python -m workbench train`) in one run folder,
    the steps they log, the steps timed (after the first of each start) and the evaluation's."""

    name: str
    lane: str
    run_dir: Path
    starts: list[list[str]]
    steps: list[int]
    timed: list[int]
    result: dict[str, Any] = field(default_factory=dict)


def tiny_paths(run_root: Path, device: str = "cuda") -> list[Path_]:
    """Each mode on each executor; two lanes per mode: in-process then the ray:// client (which
    finds the mode's vLLM compiled in the cache), and Ray started by the run."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    out = []
    for mode, mode_args in MODES.items():
        for executor, exec_args in EXECUTORS.items():
            name = f"{executor}/{mode}"
            run_dir = run_root / name.replace("/", "-")
            temp = [f"cluster.temp_dir=/tmp/wb-ray-{mode}"] if executor == "ray" else []
            args = ["--preset", "tiny", *TINY, f"model.device={device}", f"model.dtype={dtype}",
                    *mode_args, *exec_args, *temp,
                    f"run_dir={run_dir}", "trainer.ckpt_interval=2"]
            lane = f"{mode}-ray" if executor == "ray" else mode
            out.append(Path_(name, lane, run_dir, [
                [*args, "trainer.total_steps=2", "trainer.resume_mode=none",
                 "trainer.overwrite=true"],
                [*args, "trainer.total_steps=3", "trainer.resume_mode=latest"]],
                steps=[1, 2, 3], timed=[2]))
    return out


def seed_paths(run_root: Path, model: Path) -> list[Path_]:
    """seed_gpu at the 8B shape: on Ray steps 1-2, then in-process resumed from step 2 to 4."""
    run_dir = run_root / "seed_gpu-8b"
    args = ["--preset", "seed_gpu", f"model.name={model}", *SEED_8B, f"run_dir={run_dir}",
            "trainer.ckpt_interval=2"]
    return [Path_("ray/seed_gpu-8b", "8b", run_dir, [
                [*args, "cluster.address=local", "cluster.temp_dir=/tmp/wb-ray-8b",
                 "trainer.total_steps=2", "trainer.resume_mode=none", "trainer.overwrite=true"]],
                steps=[1, 2], timed=[2]),
            Path_("inprocess/seed_gpu-8b", "8b", run_dir, [
                [*args, "cluster.address=", "trainer.total_steps=4",
                 "trainer.resume_mode=latest"]], steps=[3, 4], timed=[4])]


def eight_b_left_out(total_gb: float | None, names: list[str]) -> str:
    """Why a GPU of `total_gb` runs the command without the 8B rows `names` ('' when it holds
    them, or its size is unknown)."""
    if total_gb is None or total_gb >= EIGHT_B_ROOM_GB:
        return ""
    return (f"the 8B rows left out: beside the other paths they need about {EIGHT_B_ROOM_GB:.0f}"
            f" GB, and this GPU has {total_gb:.0f} GB (--only {' '.join(names)} runs them alone)")


def gpu_total_gb() -> float | None:
    """The first GPU's memory in GB, from nvidia-smi (no CUDA context in the runner); None
    without one."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True)
        return float(done.stdout.split()[0]) * 2**20 / 1e9 if done.returncode == 0 else None
    except (OSError, ValueError, IndexError):
        return None


# ------------------------------------------------------------------------- judging a path

def first_error(log: str) -> str:
    """The line a failed start is best told by: the last exception line, else the last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception", "Exit"))
              or "Error:" in ln]
    return (errors or lines or ["(no output)"])[-1][:300]


def judge(path: Path_, logs: list[str], codes: list[int]) -> dict[str, Any]:
    """A path's row: pass or why not, and its figures from its own steps in metrics.jsonl."""
    rows = [r for r in read_metrics(path.run_dir) if "time/step" in r and r["step"] in path.steps]
    timed = [r for r in rows if r["step"] in path.timed]
    kls = [r["update/kl_sampler_trainer"] for r in rows if "update/kl_sampler_trainer" in r]
    peaks = [r["memory/gpu_peak_gb"] for r in rows if "memory/gpu_peak_gb" in r]
    return {"path": path.name, "status": verdict(path, logs, codes, rows),
            "steps": [r["step"] for r in rows],
            "step_s": statistics.median(r["time/step"] for r in timed) if timed else None,
            "kl": statistics.median(kls) if kls else None,
            "peak_gpu_gb": max(peaks) if peaks else None,
            "phases": {k.removeprefix("time/"): statistics.median(r[k] for r in timed)
                       for k in PHASES if timed and all(k in r for r in timed)},
            "speed": {k: v for k, v in (rows[-1] if rows else {}).items()
                      if k.startswith("speed/")}}


def verdict(path: Path_, logs: list[str], codes: list[int], rows: list[dict[str, Any]]) -> str:
    """"pass", or the first reason the path did not."""
    for log, code in zip(logs, codes):
        if code != 0:
            return f"exit {code}: {first_error(log)}"
    steps = [r["step"] for r in rows]
    if sorted(set(steps)) != path.steps:
        return f"steps {sorted(set(steps))} logged, not {path.steps}"
    if any("update/loss" not in r for r in rows):
        return "a step made no update"
    if "trainer.resume_mode=latest" in path.starts[-1] and "resumed from" not in logs[-1]:
        return "the last start did not resume"
    if not (path.run_dir / "eval" / f"step_{path.steps[-1]:06d}.json").is_file():
        return f"no evaluation after step {path.steps[-1]}"
    if not any(path.run_dir.glob("checkpoints/*")):
        return "no checkpoint written"
    fell = sorted(k for k, v in rows[-1].items() if k.startswith("speed/") and v == 0.0)
    if fell:
        return f"fell back: {', '.join(fell)}"
    return "pass"


# ------------------------------------------------------------------------------ running

def env_for(cache: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The child processes' environment: this checkout on PYTHONPATH (absolute: Ray workers
    start elsewhere), the command's model cache (the tiny model built once for every path), no
    Ray usage stats, no token auth on the test head, unbuffered output. This process's own
    environment is left as it is."""
    env = dict(os.environ) | {"WORKBENCH_CACHE": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
            "PYTHONUNBUFFERED": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    return env | (extra or {})


def run_logged(cmd: list[str], log_path: Path, deadline: float, env: dict[str, str]) -> int:
    """cmd in a process group of its own, its output to log_path, killed (group and all) at the
    deadline -> its exit code, 124 when killed."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(deadline - time.time(), 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return 124


def run_start(args: list[str], log_path: Path, deadline: float, niceness: int, cache: Path
              ) -> tuple[int, str]:
    """One `python -m workbench train` start, its output to log_path -> (exit code, output)."""
    code = run_logged(["nice", "-n", str(niceness), sys.executable, "-m", "workbench", "train",
                       *args], log_path, deadline, env_for(cache))
    text = log_path.read_text(errors="replace")
    if code == 124:
        text += "\nTimeoutExpired: the start ran past the command's budget"
    return code, text


def run_path(path: Path_, out: Path, deadline: float, say: Any) -> None:
    """The path's starts in turn (a failed start ends it), then its row."""
    logs, codes, t0 = [], [], time.time()
    for k, args in enumerate(path.starts):
        code, text = run_start(args, out / f"{path.name.replace('/', '-')}.{k}.log", deadline,
                               0 if path.lane == "8b" else 10, out / "cache")
        logs.append(text)
        codes.append(code)
        if code != 0:
            break
    path.result = judge(path, logs, codes) | {"wall_s": time.time() - t0}
    say(f"{path.name}: {path.result['status']} ({path.result['wall_s']:.0f} s)")


def start_head(out: Path) -> tuple[bool, str]:
    """`ray start --head` for the ray:// paths: Ray Client on CLIENT_PORT, HEAD_GPUS GPUs over
    the one card (CUDA_VISIBLE_DEVICES left as it is)."""
    temp = Path("/tmp/wb-ray-head")
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port=6399",
           f"--ray-client-server-port={CLIENT_PORT}", "--num-cpus=8", f"--num-gpus={HEAD_GPUS}",
           "--node-ip-address=127.0.0.1", "--include-dashboard=false", f"--temp-dir={temp}"]
    env = env_for(out / "cache", {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                                  "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    (out / "ray-head.log").write_text(done.stdout + done.stderr)
    return done.returncode == 0, first_error(done.stdout + done.stderr)


def stop_head(cache: Path) -> None:
    subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                   env=env_for(cache), capture_output=True, timeout=120)


def save_8b(folder: Path, log_path: Path, cache: Path) -> tuple[int, str]:
    """The 8B shape's random weights as a folder vLLM loads (`presets.save_random`)."""
    code = ("import torch; from workbench.model.presets import save_random; "
            f"save_random('qwen3-vl-8b-shape', {str(folder)!r}, torch.bfloat16, 'cuda')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_for(cache),
                          capture_output=True, text=True, timeout=240)
    log_path.write_text(done.stdout + done.stderr)
    return done.returncode, first_error(done.stdout + done.stderr)


def run_pytest(out: Path, cache: Path, deadline: float) -> dict[str, Any]:
    """`pytest -m gpu` (two workers) -> its counts (from its JUnit XML: a pytest configured to
    be quieter prints no summary line) and the failed tests' first lines."""
    log_path, xml = out / "pytest-gpu.log", out / "pytest-gpu.xml"
    cmd = ["nice", "-n", "10", sys.executable, "-m", "pytest", "-m", "gpu", "-n", "2", "-q",
           "-rf", "-p", "no:cacheprovider", f"--junitxml={xml}", *GPU_TEST_FILES]
    code = run_logged(cmd, log_path, deadline,
                      env_for(cache, {"WORKBENCH_TEST_CACHE": str(cache)}))
    text = log_path.read_text(errors="replace").splitlines()
    failed = [ln[:300] for ln in text if ln.startswith(("FAILED", "ERROR"))]
    summary = junit_summary(xml) if xml.is_file() else f"exit {code}: no JUnit XML"
    return {"path": "pytest -m gpu", "status": "pass" if code == 0 else summary,
            "summary": summary, "failed": failed}


def junit_summary(xml: Path) -> str:
    """"N passed, N failed, N skipped" from pytest's JUnit XML (errors count as failed)."""
    import xml.etree.ElementTree as ET

    suites = ET.parse(xml).getroot()
    counts = {k: sum(int(s.get(k, 0)) for s in suites.iter("testsuite"))
              for k in ("tests", "failures", "errors", "skipped")}
    failed = counts["failures"] + counts["errors"]
    return (f"{counts['tests'] - failed - counts['skipped']} passed, {failed} failed, "
            f"{counts['skipped']} skipped")


def table(rows: list[dict[str, Any]]) -> str:
    """The results as one Markdown table."""
    def num(v: Any, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    lines = ["| path | result | step s | KL sampler-trainer | peak GPU GB | phases s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r.get("phases", {}).items())
        status = r["status"] if r["status"] == "pass" else f"**{r['status']}**"
        if r["path"] == "pytest -m gpu":
            status = r["summary"] + ("" if r["status"] == "pass" else " (failed)")
        lines.append(f"| {r['path']} | {status.replace('|', '/')} | {num(r.get('step_s'), '.2f')} "
                     f"| {num(r.get('kl'), '.3g')} | {num(r.get('peak_gpu_gb'), '.1f')} "
                     f"| {phases} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="folder for the runs, logs and results "
                    "(default: a temp folder)")
    ap.add_argument("--budget", type=float, default=575.0, help="seconds for the whole command")
    ap.add_argument("--only", nargs="*", default=[], help="paths to run (names as --list)")
    ap.add_argument("--no-pytest", action="store_true", help="leave out pytest -m gpu")
    ap.add_argument("--no-8b", action="store_true", help="leave out the 8B shape's paths")
    ap.add_argument("--list", action="store_true", help="print the paths and exit")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the tiny paths of our "
                    "engine on the CPU (the runner's own test)")
    args = ap.parse_args(argv)
    start = time.time()
    deadline = start + args.budget
    out = Path(args.out or tempfile.mkdtemp(prefix="workbench-gpu-paths-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs, cache = out / "runs", out / "cache"
    seed = seed_paths(runs, out / "8b-model")
    left_out = "" if args.no_8b or args.only or args.device != "cuda" else \
        eight_b_left_out(gpu_total_gb(), [p.name for p in seed])
    paths = tiny_paths(runs, args.device) + ([] if args.no_8b or left_out else seed)
    if args.only:
        paths = [p for p in paths if p.name in args.only]
    if left_out:
        print(left_out, flush=True)
    if args.list:
        print("\n".join(p.name for p in paths))
        return 0
    lock = threading.Lock()

    def say(line: str) -> None:
        with lock:
            print(f"[{time.time() - start:5.0f} s] {line}", flush=True)

    cache.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-c", "from workbench.model import tiny_path; tiny_path()"],
                   cwd=ROOT, env=env_for(cache), check=True, capture_output=True)
    head_ok, head_error = (True, "")
    if any(p.name.startswith("ray-client/") for p in paths):
        head_ok, head_error = start_head(out)
        say(f"ray start --head: {'up' if head_ok else head_error}")
    lanes: dict[str, list[Path_]] = {}
    for p in paths:
        lanes.setdefault(p.lane, []).append(p)

    def lane(items: list[Path_]) -> None:
        if items[0].lane == "8b":
            code, error = save_8b(out / "8b-model", out / "8b-model.log", cache)
            if code != 0:
                for p in items:
                    p.result = {"path": p.name, "status": f"8B model not saved: {error}"}
                return
        for p in items:
            if p.name.startswith("ray-client/") and not head_ok:
                p.result = {"path": p.name, "status": f"no Ray head: {head_error}"}
                continue
            try:
                run_path(p, out, deadline, say)
            except Exception as err:  # noqa: BLE001 - the table says what broke the runner
                p.result = {"path": p.name, "status": f"runner: {type(err).__name__}: {err}"}

    threads = [threading.Thread(target=lane, args=(items,)) for items in lanes.values()]
    tests: dict[str, Any] = {}
    if not args.no_pytest:  # tiny-sft (test_serve_parity) built beside the rest from the start
        threads.append(threading.Thread(
            target=lambda: tests.update(run_pytest(out, cache, deadline))))
        subprocess.Popen([sys.executable, "-c", "from workbench.model.pretrained import "
                          "tiny_sft_path; tiny_sft_path()"], cwd=ROOT,
                         env=env_for(cache),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(p.name.startswith("ray-client/") for p in paths):
        stop_head(cache)
    rows = [p.result or {"path": p.name, "status": "not run"} for p in paths]
    rows += [tests] if tests else []
    text = table(rows)
    print(text)
    (out / "table.md").write_text(text + "\n")
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    (out / "results.json").write_text(json.dumps(
        {"commit": commit, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
         "wall_s": time.time() - start, "rows": rows}, indent=1))
    print(f"{sum(r['status'] == 'pass' for r in rows)} passed, "
          f"{sum(r['status'] != 'pass' for r in rows)} failed in {time.time() - start:.0f} s "
          f"at {commit}")
    shutil.rmtree("/tmp/wb-ray-head", ignore_errors=True)
    return 0 if all(r["status"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
