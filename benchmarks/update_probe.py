"""Where an update call's GPU waits: one forward_backward call of the seed_gpu trainer at the 8B
shape (4 episodes of 15 turns, random replies: the work of a random model's episodes), timed
and traced, without vLLM.

    python -m benchmarks.update_probe --out $OUT/probe.json [key=value ...]   # on a GPU
    python -m benchmarks.update_probe --out /tmp/probe.json model.name=qwen3-vl-small-shape \\
        model.device=cpu model.dtype=float32 speed.fp8_base=false speed.compile_layers=false

Builds the trainer side of a session host (`session.host.make_host`, FP8 base and compiled
layers by default), warms it with 2 calls, times `--calls` calls 3 times (median wall seconds a
call), then traces one call under torch.profiler (`trace.json.gz` beside --out) and reads the
trace as a timeline: the GPU's busy share in 20 ms slices of the call with the host operators
that ran in each, the time to the call's first GPU operation, and the GPU's busy total.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_datums(lm: Any, config: Any, n: int) -> list[Any]:
    """n datums of episodes played with fixed unparseable replies (every turn played, as a
    random model's: `bench.unparseable_reply`), advantages +-1 by episode."""
    from benchmarks.bench import InstantEngine, unparseable_reply
    from workbench.envs import eval_set
    from workbench.policy import SamplingParams
    from workbench.rl.phases import turn_datum
    from workbench.rl.rollout import play_model

    params = SamplingParams(max_tokens=8, temperature=1.0)
    states = eval_set(config.task.size, -(-n // 8))
    episodes = play_model(lm, config.task, states, 8, params, torch.Generator().manual_seed(0),
                          InstantEngine(unparseable_reply(lm)))
    flat = [e for row in episodes for e in row][:n]
    turns = config.generator.max_turns
    return [turn_datum(e.stream, np.full(turns, 1.0 if i % 2 else -1.0))
            for i, e in enumerate(flat)]


def timeline(trace: dict[str, Any], slice_ms: float = 20.0) -> dict[str, Any]:
    """A traced call read as a timeline: per slice, the GPU's busy share and the top-level host
    operators that started in it (milliseconds each)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_EVENTS), key=lambda e: e["ts"])
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    if not gpu or not ops:
        return {"slices": [], "first_gpu_ms": None, "gpu_busy_ms": 0.0}
    t0 = ops[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in ops + gpu)
    busy: Counter = Counter()
    for k in gpu:
        busy[int((k["ts"] - t0) / (slice_ms * 1e3))] += k["dur"]
    host: dict[int, Counter] = defaultdict(Counter)
    last = -1.0
    for op in ops:  # top-level: not inside the one before (per thread, good enough here)
        if op["ts"] >= last:
            host[int((op["ts"] - t0) / (slice_ms * 1e3))][op["name"][:48]] += op["dur"]
            last = op["ts"] + op["dur"]
    n = int((end - t0) / (slice_ms * 1e3)) + 1
    slices = [{"ms": i * slice_ms, "gpu_busy": round(busy[i] / (slice_ms * 1e3), 3),
               "host": [[name, round(us / 1e3, 1)] for name, us in host[i].most_common(3)]}
              for i in range(n)]
    return {"slices": slices, "call_ms": (end - t0) / 1e3,
            "first_gpu_ms": (gpu[0]["ts"] - t0) / 1e3,
            "gpu_busy_ms": sum(k["dur"] for k in gpu) / 1e3}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="JSON file (the trace goes beside it)")
    ap.add_argument("--calls", type=int, default=4, help="calls a timed repeat")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    from workbench.config import PRESETS, apply_overrides
    from workbench.opener import session_spec
    from workbench.rl.schedule import step_update
    from workbench.session.host import forward, make_host

    config = apply_overrides(PRESETS["seed_gpu"], [
        "model.name=qwen3-vl-8b-shape", "engine.name=transformers", "speed.fp8_base=true",
        "algorithm.tis_cap=2", "generator.temperature=1.0"] + args.overrides)
    out_dir = Path(args.out).parent if args.out else Path("/tmp")
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    host = make_host(session_spec(config, out_dir / "probe_run"), trainer=True, sampler=False)
    out: dict[str, Any] = {"overrides": args.overrides, "host_up_s": time.perf_counter() - start}
    m = config.algorithm.minibatch
    datums = random_datums(host.lm, config, m * (args.calls + 2))
    out["tokens_per_datum"] = float(np.mean([len(d.stream) for d in datums]))
    loss = step_update(config, 1).loss

    def call(i: int) -> None:
        forward(host, datums[i * m:(i + 1) * m], config.algorithm.loss, loss, True)

    start = time.perf_counter()
    call(0)
    call(1)
    sync()
    out["warm_s"] = time.perf_counter() - start
    walls = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        for i in range(args.calls):
            call(i + 2)
        sync()
        walls.append((time.perf_counter() - start) / args.calls)
    out["call_s"] = statistics.median(walls)
    out["call_s_repeats"] = walls
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        call(2)
        sync()
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    out["timeline"] = timeline(json.loads(trace.read_text()))
    with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
        g.write(f.read())
    trace.unlink()
    host.optimizer.zero_grad(set_to_none=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "timeline"} | {
        "first_gpu_ms": out["timeline"]["first_gpu_ms"],
        "gpu_busy_ms": out["timeline"]["gpu_busy_ms"]}, indent=1))
    return out


if __name__ == "__main__":
    main()
