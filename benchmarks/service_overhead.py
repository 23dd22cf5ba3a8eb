"""The session server's overhead per step: one loop, in-process and through the server.

    python -m benchmarks.service_overhead                       # CPU: tiny-sft
    python -m benchmarks.service_overhead --steps 3 --out runs/bench/service.json   # CUDA: 8B
    python -m benchmarks.service_overhead --mazes 2 --turns 6 algorithm.minibatch=2   # 80 GB

The loop is a multi-turn maze GRPO step written against the workbench's client methods: a
sampling client of the current weights; every live episode's next reply sampled by a request
of its own (`service.remote.RemoteEngine`: the first turn's G rows of a maze in one request of
G samples), all of a turn's requests in flight together; rewards, group advantages,
`forward_backward` (importance_sampling, summed) over chunks of `algorithm.minibatch` datums,
all in flight, as the workbench's update sends them, and `optim_step`. It runs first on a session
opened in this process (the workbench's clients), then, after that session is closed, on the
same spec behind `python -m workbench session-server` in a process of its own (as a service
runs), driven through `service.remote.connect_service` (the official tinker SDK, HTTP,
protobuf, PNG images): the difference is the service's overhead. On CUDA the spec is seed_gpu
on `qwen3-vl-8b-shape` (random bf16 weights, saved once for vLLM); on the CPU tiny-sft. Every
datum gets advantage +-1 by episode index (a random model earns one reward).
Prints each step and a JSON summary (medians after --warmup steps).

Answers: What does the session server add to a step, against the same loop in-process? Figures:
benchmarks/RESULTS.md, "Sessions as a service".
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from benchmarks.gpu import save
from workbench.serve.deploy import free_port

KEY = "tml-bench"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-vl-8b-shape" if cuda else "tiny-sft")
    ap.add_argument("--mazes", type=int, default=8 if cuda else 2, help="P")
    ap.add_argument("--group", type=int, default=8 if cuda else 4, help="G")
    ap.add_argument("--turns", type=int, default=15 if cuda else 4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. "
                    "algorithm.minibatch=2: fewer datums a forward_backward on an 80 GB GPU)")
    return ap.parse_args(argv)


def spec_of(args: argparse.Namespace, workdir: Path) -> tuple[Any, Any, list[str]]:
    """(SessionSpec, RunConfig, the command line's preset and overrides): the device's preset
    at the asked shape."""
    from workbench.config import PRESETS, apply_overrides
    from workbench.model.presets import SHAPES, save_random
    from workbench.opener import session_spec

    cuda = torch.cuda.is_available()
    model = args.model
    if cuda and model in SHAPES:
        model = save_random(model, workdir / "model", torch.bfloat16, "cuda")
    preset = "seed_gpu" if cuda else "tiny"
    overrides = [
        f"model.name={model}", f"trainer.train_batch_size={args.mazes}",
        f"generator.n_samples_per_prompt={args.group}", f"generator.max_turns={args.turns}",
        f"generator.max_tokens={args.max_tokens}", f"run_dir={workdir / 'session'}",
        *args.overrides]
    config = apply_overrides(PRESETS[preset], overrides)
    return session_spec(config, workdir / "session"), config, ["--preset", preset, *overrides]


def serve(command: list[str], workdir: Path, log: Any) -> tuple[subprocess.Popen, str]:
    """`python -m workbench session-server` with the same spec, once it answers."""
    port = free_port()
    out = open(workdir / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "workbench", "session-server", "--port",
                             str(port), "--api-key", KEY, *command], stdout=out,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while proc.poll() is None:
        try:
            if httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": KEY}).status_code == 200:
                log(f"session server {url} (pid {proc.pid})")
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"the session server exited: {(workdir / 'server.log').read_text()[-2000:]}")


def step(tc: Any, config: Any, it: int, args: argparse.Namespace) -> dict[str, float]:
    """One GRPO step of the loop -> its phase times."""
    from workbench.model.loaded import LoadedModel
    from workbench.policy import SamplingParams
    from workbench.rl.rollout import play_episodes
    from workbench.rl.schedule import step_mazes
    from workbench.service.remote import RemoteEngine
    from workbench.session import AdamParams, LossConfig, datum_from_stream

    start = time.perf_counter()
    sampler = tc.save_weights_and_get_sampling_client()
    lm = LoadedModel(model=None, processor=tc.get_processor(), source="", path="")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    sampled = time.perf_counter()
    episodes = play_episodes(lm, RemoteEngine(sampler), config.task, step_mazes(config, it),
                             args.group, params, it)
    played = time.perf_counter()
    flat = [ep for group in episodes for ep in group]
    datums = [datum_from_stream(ep.stream, 1.0 if i % 2 == 0 else -1.0)
              for i, ep in enumerate(flat)]
    size = config.algorithm.minibatch  # datums a call, as the workbench's update sends them
    futures = [tc.forward_backward(datums[i:i + size], "importance_sampling",
                                   LossConfig(reduction="sum"))
               for i in range(0, len(datums), size)]
    tc.optim_step(AdamParams(learning_rate=1e-5)).result()
    done = time.perf_counter()
    return {"step_s": done - start, "sync_s": sampled - start, "rollout_s": played - sampled,
            "update_s": done - played, "loss": sum(f.result().loss for f in futures),
            "tokens": float(np.mean([len(ep.stream) for ep in flat]))}


def run(tc: Any, config: Any, args: argparse.Namespace, log: Any, name: str
        ) -> list[dict[str, float]]:
    rows = []
    for it in range(1, args.warmup + args.steps + 1):
        rows.append(step(tc, config, it, args))
        log(f"{name} step {it}: " + "  ".join(f"{k} {v:.3f}" for k, v in rows[-1].items()))
    return rows[args.warmup:]


def bench(argv: list[str] | None = None, log: Any = print) -> dict[str, Any]:
    from workbench.opener import open_session
    from workbench.service.remote import connect_service

    args = parse(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="workbench-service-"))
    spec, config, command = spec_of(args, workdir)
    session = open_session(spec, log=log)
    try:
        inprocess = run(session.training_client, config, args, log, "in-process")
    finally:
        session.close()
    save({"inprocess_steps": inprocess}, args.out)  # kept if the server's half is cut short
    proc, url = serve(command, workdir, log)
    try:
        remote = connect_service(url, KEY, spec.model,  # the same first adapter
                                 seed=spec.lora.init_seed if spec.lora else 0)
        served = run(remote.training_client, config, args, log, "server")
        remote.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
           for name, rows in (("inprocess", inprocess), ("server", served))}
    summary = {"model": args.model, "P": args.mazes, "G": args.group, "turns": args.turns,
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               **med, "overhead": med["server"]["step_s"] / med["inprocess"]["step_s"] - 1,
               # the same seeds and weights: the same episodes, so the same losses
               "same_losses": all(math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-6)
                                  for a, b in zip(inprocess, served))}
    save(summary, args.out)
    return summary


if __name__ == "__main__":
    print(json.dumps(bench(), indent=1))
