"""Where an update call's GPU waits: one forward_backward call of the seed_gpu trainer at the 8B
shape (4 episodes of 15 turns, random replies: the work of a random model's episodes), timed
and traced, without vLLM.

    python -m benchmarks.update_probe --out $OUT/probe.json [key=value ...]   # on a GPU
    python -m benchmarks.update_probe --out /tmp/probe.json model.name=qwen3-vl-small-shape \\
        model.device=cpu model.dtype=float32 speed.fp8_base=false speed.compile_layers=false

Builds the trainer side of a session host (`session.host.make_host`, FP8 base and compiled
layers by default) and its in-process session lane, warms it with 2 calls, times `--calls`
calls queued back to back on the lane 3 times (median wall seconds a call: the lane launches a
call before reading back the one before it), then traces one call under torch.profiler
(`trace.json.gz` beside --out) and reads the trace as a timeline: the GPU's busy share in 20 ms
slices of the call with the host operators that ran in each, the time to the call's first GPU
operation, and the GPU's busy total. On a GPU it also lists where one call's launch still makes
the host wait for the device (`host_waits`: torch's sync debug mode, by source line) and times
the call's attention (forward and backward, one layer's shape) on each SDPA backend.

Answers: Where does an update call's GPU wait? Figures: benchmarks/RESULTS.md, "The update on
the H200".
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
import traceback
import warnings
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


def host_waits(launch: Any) -> dict[str, int]:
    """Where launch() makes the host wait for the GPU: torch's CUDA sync debug warnings during
    the call, counted by the innermost workbench, transformers or peft source line above them
    (syncs in autograd's own threads are not seen from Python)."""
    seen: Counter = Counter()

    def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        frames = [f for f in traceback.extract_stack()[:-1]
                  if any(k in f.filename for k in ("workbench/", "transformers/", "peft/"))]
        where = frames[-1] if frames else None
        seen[f"{where.filename.split('site-packages/')[-1]}:{where.lineno}" if where
             else f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            launch()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(seen.most_common())


def attention_backends(batch: int, length: int, repeats: int = 5) -> dict[str, Any]:
    """Forward and backward of one text layer's causal attention at an update call's shape (the
    8B shape's 32 query and 8 KV heads of 128, bf16, GQA inside the kernel) on each SDPA backend
    that takes it: median milliseconds and the output's largest difference from flash's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32, length, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    grad = torch.randn_like(q)
    out: dict[str, Any] = {}
    reference = None
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        times = []
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                for _ in range(repeats + 1):
                    sync()
                    start = time.perf_counter()
                    o = torch.nn.functional.scaled_dot_product_attention(
                        qs, ks, vs, is_causal=True, enable_gqa=True)
                    o.backward(grad)
                    sync()
                    times.append((time.perf_counter() - start) * 1e3)
        except RuntimeError as exc:
            out[name] = {"error": str(exc).splitlines()[0][:160]}
            continue
        reference = o.detach() if reference is None else reference
        out[name] = {"ms": statistics.median(times[1:]),
                     "max_diff_from_flash": float((o.detach() - reference).abs().max())}
    return out


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
    from workbench.session.host import launch_forward, make_host, read_back
    from workbench.session.inprocess import Session

    config = apply_overrides(PRESETS["seed_gpu"], [
        "model.name=qwen3-vl-8b-shape", "engine.name=transformers", "speed.fp8_base=true",
        "algorithm.tis_cap=2", "generator.temperature=1.0"] + args.overrides)
    out_dir = Path(args.out).parent if args.out else Path("/tmp")
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    host = make_host(session_spec(config, out_dir / "probe_run"), trainer=True, sampler=False)
    session = Session(host)
    out: dict[str, Any] = {"overrides": args.overrides, "host_up_s": time.perf_counter() - start}
    m = config.algorithm.minibatch
    datums = random_datums(host.lm, config, m * (args.calls + 2))
    out["tokens_per_datum"] = float(np.mean([len(d.stream) for d in datums]))
    loss = step_update(config, 1).loss

    def calls(first: int, n: int) -> None:
        tc = session.training_client
        futures = [tc.forward_backward(datums[i * m:(i + 1) * m], config.algorithm.loss, loss)
                   for i in range(first, first + n)]
        for f in futures:
            f.result()
        sync()

    start = time.perf_counter()
    calls(0, 2)
    out["warm_s"] = time.perf_counter() - start
    walls = []
    for _ in range(3):
        sync()
        start = time.perf_counter()
        calls(2, args.calls)
        walls.append((time.perf_counter() - start) / args.calls)
    out["call_s"] = statistics.median(walls)
    out["call_s_repeats"] = walls
    if torch.cuda.is_available():
        launched: list[Any] = []
        out["host_waits"] = host_waits(lambda: launched.append(launch_forward(
            host, datums[2 * m:3 * m], config.algorithm.loss, loss, True)))
        read_back(launched[0])
        out["attention_ms"] = attention_backends(m, int(out["tokens_per_datum"]))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:  # on this thread: the profiler's own
        read_back(launch_forward(host, datums[2 * m:3 * m], config.algorithm.loss, loss, True))
        sync()
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    out["timeline"] = timeline(json.loads(trace.read_text()))
    with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
        g.write(f.read())
    trace.unlink()
    session.close()
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "timeline"} | {
        "first_gpu_ms": out["timeline"]["first_gpu_ms"],
        "gpu_busy_ms": out["timeline"]["gpu_busy_ms"]}, indent=1))
    return out


if __name__ == "__main__":
    main()
