"""Serving benchmark: the workbench's own OpenAI-compatible endpoint (one base, LoRA adapters as
`base:a1`, `base:a2`, ...) driven by `openai.AsyncOpenAI` with --requests concurrent chat requests
spread over the adapters, each a maze image (PNG data URL) and its text, max_tokens 16; once per
--engine, one after the other: vllm (vLLM's async engine: requests batch) and/or transformers
(our sampler: one request at a time). One summary line per engine; serve_bench.json in --out.

    python -m benchmarks.serve_bench --engine vllm,transformers --out OUT        # CUDA + vLLM
    python -m benchmarks.serve_bench --engine transformers --device cpu --requests 6   # a CPU

Nothing is downloaded. --model: "tiny" (the tiny Qwen3-VL, built into --workdir), a checkpoint
folder, or a shape of workbench.model.presets (random weights, saved to --workdir: vLLM loads from
disk). The adapters: one session on that base (LoRA r--rank on the language model), its lora_B
set to random values (so each adapter changes the replies) before each export, published with the
registry to a local folder store. The endpoint runs in this process (`serve(..., address="")`).

Timed: after a warm-up (one request per adapter and one on the base, other mazes), one wave of
--requests requests sent at once. Figures: requests/s and completion tokens/s over the wave's
wall time, latency p50 / p95 / max, requests per adapter, the replica's /v1/stats counters and
the endpoint's start-up time (vLLM: engine start, torch.compile and CUDA graph capture).

Answers: How fast does the endpoint serve a base and its adapters, against vLLM's own server?
Figures: benchmarks/RESULTS.md, "Serving".
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="vllm,transformers",
                        help="comma-separated engines, run one after the other")
    parser.add_argument("--requests", type=int, default=50, help="concurrent requests timed")
    parser.add_argument("--adapters", type=int, default=3, help="adapters the requests spread over")
    parser.add_argument("--model", default="tiny", help="tiny, a checkpoint folder or a shape")
    parser.add_argument("--device", default="", help="cuda or cpu (default: cuda if available); "
                        "where the adapters are made and the transformers engine runs")
    parser.add_argument("--dtype", default="", help="the adapters' and transformers engine's "
                        "dtype (default: bfloat16 on cuda, float32 on cpu); vLLM runs bfloat16")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of the adapters")
    parser.add_argument("--lora-b-std", type=float, default=0.5, help="std of the random lora_B")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--maze-size", type=int, default=7)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share")
    parser.add_argument("--workdir", default="/tmp/serve-bench", help="models, adapters, store")
    parser.add_argument("--out", default=".", help="folder for serve_bench.json")
    return parser.parse_args()


# ------------------------------------------------------------------ the base and its adapters


def base_folder(model: str, workdir: Path, device: str) -> str:
    """A checkpoint folder of `model`: the tiny default built locally, a shape's random weights
    saved once, or the folder given."""
    from workbench.model import TINY_NAME, tiny_path
    from workbench.model.presets import SHAPES, save_random

    if model == TINY_NAME:
        return str(tiny_path(root=workdir))
    if model not in SHAPES:
        return model
    return save_random(model, workdir / "models" / model, device=device)  # bf16, as vLLM serves


def make_adapters(folder: str, n: int, args: argparse.Namespace, workdir: Path) -> str:
    """Export n adapters with random lora_B from one session on `folder`, publish them as a1..an
    in a local store; returns the store's root."""
    import torch

    from workbench import registry, storage
    from workbench.model import LoraSettings
    from workbench.session import SessionSpec, create_session

    store = storage.open_store(workdir / "store")
    session = create_session(SessionSpec(folder, LoraSettings(rank=args.rank, alpha=2 * args.rank),
                                         workdir=str(workdir / "session"), device=args.device,
                                         dtype=args.dtype))
    try:
        for k in range(1, n + 1):
            gen = torch.Generator().manual_seed(k)
            with torch.no_grad():
                for key, p in session.host.trainable().items():
                    if "lora_B" in key:
                        noise = torch.randn(p.shape, generator=gen) * args.lora_b_std
                        p.copy_(noise.to(p.device, p.dtype))
            export = session.training_client.export(
                workdir / f"a{k}" / "exports" / "global_step_1", "adapter").result()
            registry.publish(store, export, f"a{k}", eval_results={}, overwrite=True)
    finally:
        session.close()
    return store.root


# ------------------------------------------------------------------ the requests


def conversations(maze_size: int, count: int, offset: int = 0) -> list[list[dict[str, Any]]]:
    """`count` first turns of different mazes (eval seeds from `offset`, cycling over 64): the
    system rules, then the maze image and the rollout's text."""
    from workbench.envs import MazeConfig, MazeEnv, eval_set, system_prompt
    from workbench.serve.client import user_message

    config, states = MazeConfig(size=maze_size), eval_set(maze_size, 64)
    out = []
    for i in range(offset, offset + count):
        env = MazeEnv(config)
        obs, info = env.reset(options={"init_state": states[i % len(states)]})
        out.append([{"role": "system", "content": system_prompt(config)},
                    user_message(obs, info, config)])
    return out


async def send_all(base_url: str, models_R: list[str], messages_R: list[list[dict[str, Any]]],
                   max_tokens: int, temperature: float) -> tuple[list[dict[str, Any]], float]:
    """Send every request at once; per-request records and the wall time of the whole wave."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0,
                                  timeout=600) as client:
        async def one(model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
            t0 = time.perf_counter()
            r = await client.chat.completions.create(model=model, messages=messages,
                                                     max_tokens=max_tokens,
                                                     temperature=temperature)
            return {"model": model, "latency_s": time.perf_counter() - t0,
                    "prompt_tokens": r.usage.prompt_tokens,
                    "completion_tokens": r.usage.completion_tokens}

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(m, msg) for m, msg in zip(models_R, messages_R)))
        return list(records), time.perf_counter() - t0


def summary(records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """requests/s, completion tokens/s, latency percentiles, requests per model."""
    latency = sorted(r["latency_s"] for r in records)
    tokens = sum(r["completion_tokens"] for r in records)
    per_model: dict[str, int] = {}
    for r in records:
        per_model[r["model"]] = per_model.get(r["model"], 0) + 1
    return {"requests": len(records), "wall_s": wall_s, "requests_per_s": len(records) / wall_s,
            "completion_tokens": tokens, "completion_tokens_per_s": tokens / wall_s,
            "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in records),
            "latency_p50_s": statistics.median(latency),
            "latency_p95_s": latency[min(len(latency) - 1, round(0.95 * (len(latency) - 1)))],
            "latency_max_s": latency[-1], "per_model": per_model}


def replica_stats(base_url: str) -> dict[str, Any]:
    """The replica's /v1/stats (adapter cache counters)."""
    with urllib.request.urlopen(f"{base_url}/stats") as response:
        return json.loads(response.read())


# ------------------------------------------------------------------ one engine


def bench_engine(engine: str, folder: str, store_root: str, args: argparse.Namespace
                 ) -> dict[str, Any]:
    """Start the endpoint on `engine`, warm it up, time one wave of concurrent requests, stop."""
    from workbench.serve import serve, shutdown

    names = [f"a{k}" for k in range(1, args.adapters + 1)]
    models_R = [f"base:{names[i % len(names)]}" for i in range(args.requests)]
    messages_R = conversations(args.maze_size, args.requests)
    warm = ["base", *(f"base:{n}" for n in names)]
    t0 = time.perf_counter()
    endpoint = serve(folder, adapters=store_root, port=0, address="", engine=engine,
                     served_name="base", cache_size=max(args.adapters, 1), device=args.device,
                     dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                     cache_dir=str(Path(args.workdir) / "cache"))
    up_s = time.perf_counter() - t0
    try:
        for model, messages in zip(warm, conversations(args.maze_size, len(warm), 64 - len(warm))):
            asyncio.run(send_all(endpoint.base_url, [model], [messages], args.max_tokens,
                                 args.temperature))
        records, wall_s = asyncio.run(send_all(endpoint.base_url, models_R, messages_R,
                                               args.max_tokens, args.temperature))
        stats = replica_stats(endpoint.base_url)
    finally:
        shutdown(endpoint)
    counters = {k: stats[k] for k in ("requests", "hits", "misses", "evictions", "fetches",
                                      "load_failures")}
    return {"engine": engine, "up_s": up_s, **summary(records, wall_s), "stats": counters}


def line(result: dict[str, Any], args: argparse.Namespace) -> str:
    """One summary line of an engine's figures."""
    r = result
    return (f"{r['engine']}: {r['requests']} concurrent requests over {args.adapters} adapters "
            f"({args.model}, max_tokens {args.max_tokens}, {args.device}): "
            f"{r['requests_per_s']:.2f} req/s, {r['completion_tokens_per_s']:.0f} completion "
            f"tokens/s; latency p50 {r['latency_p50_s']:.3f} s, p95 {r['latency_p95_s']:.3f} s, "
            f"max {r['latency_max_s']:.3f} s; per adapter {r['per_model']}; up in "
            f"{r['up_s']:.0f} s; cache misses {r['stats']['misses']}, hits {r['stats']['hits']}, "
            f"evictions {r['stats']['evictions']}")


def main() -> None:
    args = parse_args()
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    workdir, out = Path(args.workdir), Path(args.out)
    workdir.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder = base_folder(args.model, workdir, args.device)
    store_root = make_adapters(folder, args.adapters, args, workdir)
    print(f"base {folder}; {args.adapters} adapters (LoRA r{args.rank}, {args.dtype}) published "
          f"to {store_root} in {time.perf_counter() - t0:.1f} s", flush=True)
    report: dict[str, Any] = {"args": vars(args), "python": platform.python_version(),
                              "torch": torch.__version__, "engines": {}}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
    failed = []
    for engine in [e.strip() for e in args.engine.split(",") if e.strip()]:
        try:
            result = bench_engine(engine, folder, store_root, args)
            print(line(result, args), flush=True)
        except Exception as err:
            traceback.print_exc()
            result, failed = {"engine": engine, "error": f"{type(err).__name__}: {err}"}, \
                failed + [engine]
            print(f"{engine}: FAILED {result['error']}", flush=True)
        report["engines"][engine] = result
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        (out / "serve_bench.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'serve_bench.json'}", flush=True)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
