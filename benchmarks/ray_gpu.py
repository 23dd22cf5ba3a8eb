"""Ray on GPUs: the seed's GRPO step in-process and on Ray actors, data-parallel update agreement,
weight-sync times, vLLM engines inside Ray actors. One line of figures per section; every
section's record goes into <out>/ray_gpu.json (sections may run as parallel processes).

    python3 benchmarks/ray_gpu.py --sections inprocess --out $OUT            # H200, GPU 0
    python3 benchmarks/ray_gpu.py --sections ray2_colocated,ray_split --out $OUT
    python benchmarks/ray_gpu.py --shape tiny --device cpu --sections inprocess,ray1 --small
    (benchmarks/gpu_runs/ray_x2.sh runs them all on a 2-GPU machine, ray_x1.sh those one GPU
    allows; the device commands are in benchmarks/RESULTS.md)

Sections:
- inprocess: one GPU, one GRPO step of 8 mazes x 8 samples, 15 turns (the 8B shape, random bf16
  weights) through the in-process session, as benchmarks/gpu.py times it (advantages +-1 by
  episode parity: a random model earns no reward).
- ray1: the same on Ray (cluster.address=local), 1 trainer worker + 1 engine; Ray overhead =
  ray1 / inprocess - 1 (the two may run at once, on GPUs of their own).
- ray2_colocated: 2 trainer workers (NCCL) + 2 engines, colocate_all=true, 2 GPUs; and the
  update of the same datums against 1 worker (written by ray1 to --share).
- ray_split: colocate_all=false: on 2 GPUs only 1 worker + 1 engine fit (2 + 2 needs 4 GPUs);
  with weight_sync, the 8B LoRA's sync through the object store and over NCCL (median of 3).
- vllm_actors: the tiny model (bf16) with generator.engine=vllm in --vllm-actors engine actors
  colocated with as many trainers (one a GPU): a short rollout, one update, each actor's GPU
  memory and vLLM's share.
- pipeline: trainer.off_policy_steps=1 against on-policy steps, the seed_gpu settings as they are
  (vLLM with merged weights in a 0.3 share, compiled layers) on Ray, 1 trainer + 1 engine
  colocated on one GPU: the next rollout runs in the engine's process while the trainer's
  process updates, the GPU shared between them.
- pipeline_inprocess: the same in-process, as seed_gpu runs by default: vLLM samples in its own
  process, driven from the session's sampler lane (a thread), while this process updates.
- summary: reads ray_gpu.json and prints the comparisons.

Settings, for time and memory: no compilation (generator.compile_decode=false,
trainer.compile_layers=false: compiling takes minutes per process), one short warm-up (a 2-turn
rollout, which captures the first CUDA graphs, and one update call), then one timed step. A
colocated GPU holds a trainer (17.5 GB of weights + update) and an engine (its own 17.5 GB + the
fused decode copy 13.9 GB + its KV pool), so the trainer uses full gradient checkpointing at 8
episodes a forward_backward call (about 47 GB at 16 in-process), the same settings everywhere.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pickle
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu import GpuBusy  # noqa: E402  (benchmarks/gpu.py: NVML's busy time)
from vllm_agreement import save_shape  # noqa: E402  (benchmarks/: the 8B shape saved for vLLM)

from workbench.config import PRESETS, apply_overrides  # noqa: E402
from workbench.envs import MazeConfig, eval_set  # noqa: E402
from workbench.opener import open_session, session_spec  # noqa: E402
from workbench.policy import SamplingParams  # noqa: E402
from workbench.rl import phases  # noqa: E402
from workbench.session.losses import LossConfig  # noqa: E402
from workbench.session.spec import ClusterSpec, SessionSpec  # noqa: E402
from workbench.session.types import AdamParams, Datum, datum_from_stream  # noqa: E402

T0 = time.time()
COMPARE_ADAM = AdamParams(learning_rate=1e-4, eps=1e-6)  # eps: see compare_records
# Tolerances of the 2-worker update against 1 worker on the same datums. Every forward sees the
# same batches (8 datums; 2 workers: 8 each of a 16-datum call), so the bf16 forwards match, up
# to the nondeterministic attention backward (atomics); what differs is the fp32 gradient sum's
# order ((g1+g2)+g3 vs (g1+g3)+g2 + all-reduce) and those bf16 roundings. Adam's first step,
# lr * g / (|g| + eps), turns a rounding dg of a near-zero g into at most lr * dg / eps.
TOL = {"loss_rel": 1e-3, "grad_norm_rel": 1e-3, "update_rel": 1e-2}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def record(out: Path, section: str, row: dict[str, Any]) -> None:
    """Merge {section: row} into out/ray_gpu.json under a lock (parallel sections)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ray_gpu.json"
    with open("/tmp/ray_gpu.lock", "w") as lock:  # not in out: 8 files come back
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[section] = row
        path.write_text(json.dumps(data, indent=1, default=str))


# ------------------------------------------------------------------------------------ settings


def run_config(args: argparse.Namespace) -> Any:
    """The seed_gpu preset at this benchmark's sizes (see the module docstring)."""
    gpu = args.device == "cuda"
    return apply_overrides(PRESETS["seed_gpu"], [
        f"model.name={args.shape}", f"model.device={args.device}",
        f"model.dtype={'bfloat16' if gpu else 'float32'}",
        "generator.compile_decode=false", "trainer.compile_layers=false",
        "trainer.gradient_checkpointing=true", f"trainer.minibatch={args.minibatch}",
        f"trainer.train_batch_size={args.mazes}", f"generator.n_samples_per_prompt={args.group}",
        f"generator.max_turns={args.turns}", f"generator.max_tokens={args.max_tokens}",
        f"generator.gpu_memory_utilization={args.engine_share}"])


def make_spec(args: argparse.Namespace, workdir: Path, cluster: ClusterSpec) -> SessionSpec:
    spec = session_spec(run_config(args), workdir)
    speed = replace(spec.speed, kv_tokens=args.kv_tokens)
    return replace(spec, speed=speed, cluster=cluster)


def maze(args: argparse.Namespace, turns: int | None = None) -> MazeConfig:
    """The seed's easy 9x9 mazes at 25 px (VisGym's tuple grammar and reward)."""
    return replace(run_config(args).task, max_turns=turns or args.turns)


# ------------------------------------------------------------------------------------ one step


def parity_datums(episodes: list) -> list[Datum]:
    """Advantages +-1 by episode parity (a random model earns no reward), batch-mean weights,
    shortest first (less padding), as benchmarks/gpu.py does."""
    datums = [datum_from_stream(ep.stream, 1.0 if k % 2 else -1.0)
              for k, ep in enumerate(episodes)]
    return sorted(phases.global_weights(datums, "sequence_mean"), key=lambda d: len(d.stream))


def update(session: Any, datums: list[Datum], chunk: int, adam: AdamParams) -> tuple[list, Any]:
    """forward_backward over chunks of `chunk` datums (all queued), then one optim_step."""
    tc, summed = session.training_client, LossConfig(reduction="sum")
    futures = [tc.forward_backward(datums[i:i + chunk], "ppo", summed)
               for i in range(0, len(datums), chunk)]
    opt = tc.optim_step(adam)
    return [f.result() for f in futures], opt.result()


def grpo_step(session: Any, args: argparse.Namespace, seed: int, turns: int | None = None,
              update_datums: int | None = None) -> dict[str, Any]:
    """One GRPO step through the session, timed per phase on the host clock (each phase's
    result is back in this process, so its GPU work is done)."""
    t = [time.perf_counter()]
    sampler = session.training_client.save_weights_and_get_sampling_client()
    t.append(time.perf_counter())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    ro = phases.rollout(sampler, phases.Batch(maze(args, turns), eval_set(9, args.mazes),
                                              args.group, params, seed))
    t.append(time.perf_counter())
    sc = phases.score(ro)
    phases.advantages(sc.rewards_P_G, "grpo")
    datums = parity_datums(ro.flat)[:update_datums]
    t.append(time.perf_counter())
    outs, opt = update(session, datums, args.minibatch * args.workers,
                       AdamParams(learning_rate=1e-6))
    t.append(time.perf_counter())
    return {"step_s": t[-1] - t[0], "handoff_s": t[1] - t[0], "rollout_s": t[2] - t[1],
            "score_s": t[3] - t[2], "update_s": t[4] - t[3], "episodes": len(ro.flat),
            "episode_tokens_mean": statistics.mean(len(ep.stream) for ep in ro.flat),
            "update_tokens": sum(len(d.stream) for d in datums), "grad_norm": opt.grad_norm,
            "rollout": ro}


def timed_step(session: Any, args: argparse.Namespace, captures: Callable[[], float]
               ) -> dict[str, Any]:
    """A warm-up (2-turn rollout, one update call), then one timed step; CUDA-graph capture
    seconds inside the timed rollout are reported (and taken out of `step_net_s`)."""
    warm = grpo_step(session, args, seed=99, turns=2, update_datums=args.minibatch * args.workers)
    before = captures()
    step = grpo_step(session, args, seed=0)
    step["capture_s"] = captures() - before
    step["step_net_s"] = step["step_s"] - step["capture_s"]
    step["warmup_s"] = warm["step_s"]
    step.pop("rollout")
    return step


def step_line(name: str, r: dict[str, Any]) -> str:
    return (f"{name}: step {r['step_s']:.2f} s (net of graph captures {r['step_net_s']:.2f}) = "
            f"handoff {r['handoff_s']:.3f} + rollout {r['rollout_s']:.2f} (captures "
            f"{r['capture_s']:.2f}) + score {r['score_s']:.3f} + update {r['update_s']:.2f}; "
            f"{r['episodes']} episodes of {r['episode_tokens_mean']:.0f} tokens; warm-up "
            f"{r['warmup_s']:.1f} s")


# ------------------------------------------------------------------------------ update agreement


def compare_update(session: Any, args: argparse.Namespace, datums: list[Datum],
                   weights: Callable[[], dict[str, torch.Tensor]]) -> dict[str, Any]:
    """One update of `datums` from the fresh weights: each forward sees `args.minibatch` datums
    whatever the worker count. Returns loss, grad norm, the weights before and after (CPU)."""
    before = weights()
    outs, opt = update(session, datums, args.minibatch * args.workers, COMPARE_ADAM)
    return {"loss": sum(o.loss for o in outs), "grad_norm": opt.grad_norm,
            "tokens": sum(o.metrics["tokens"] for o in outs), "before": before,
            "after": weights()}


def compare_records(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """The update of `got` against `ref`: relative loss and grad-norm differences, max |dW|
    (and in units of the learning rate), and |dW_got - dW_ref| / |dW_ref| over all tensors."""
    same_init = max(float((got["before"][k] - ref["before"][k]).abs().max())
                    for k in ref["before"])
    worst = max(float((got["after"][k] - ref["after"][k]).abs().max()) for k in ref["after"])
    diff2 = sum(float(((got["after"][k] - got["before"][k]) - (ref["after"][k] - ref["before"][k]))
                      .double().pow(2).sum()) for k in ref["after"])
    norm2 = sum(float((ref["after"][k] - ref["before"][k]).double().pow(2).sum())
                for k in ref["after"])
    out = {"loss_rel": abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12),
           "grad_norm_rel": abs(got["grad_norm"] - ref["grad_norm"]) / max(ref["grad_norm"], 1e-12),
           "max_abs_dW": worst, "max_abs_dW_in_lr": worst / COMPARE_ADAM.learning_rate,
           "update_rel": (diff2 / max(norm2, 1e-30)) ** 0.5, "init_max_abs_diff": same_init,
           "loss": (ref["loss"], got["loss"]), "grad_norm": (ref["grad_norm"], got["grad_norm"]),
           "tolerance": TOL}
    out["within_tolerance"] = all(out[k] <= v for k, v in TOL.items()) and same_init == 0.0
    return out


def compare_line(name: str, c: dict[str, Any]) -> str:
    return (f"{name}: loss rel {c['loss_rel']:.1e}, grad norm rel {c['grad_norm_rel']:.1e}, "
            f"update rel {c['update_rel']:.1e}, max |dW| {c['max_abs_dW']:.2e} "
            f"({c['max_abs_dW_in_lr']:.3f} lr), same init {c['init_max_abs_diff'] == 0.0} -> "
            f"{'within' if c['within_tolerance'] else 'OUTSIDE'} tolerance {TOL}")


def save_share(args: argparse.Namespace, name: str, obj: Any) -> None:
    path = Path(args.share) / f"{name}.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def load_share(args: argparse.Namespace, name: str) -> Any:
    path = Path(args.share) / f"{name}.pkl"
    if not path.exists():
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


# ------------------------------------------------------------------------------------ sessions


def _captures(host: Any) -> float:
    static = getattr(host.engine, "static", None) or host.static
    return float(static.capture_seconds) if static is not None else 0.0


def _trainable_cpu(host: Any) -> dict[str, torch.Tensor]:
    from workbench.session.host import snapshot, trainer_weights

    trainer_weights(host)
    return {k: v.float().cpu() for k, v in snapshot(host).items()}


def ray_captures(session: Any) -> Callable[[], float]:
    import ray

    return lambda: sum(ray.get([e.call.remote(_captures) for e in session.engines]))


def ray_weights(session: Any) -> Callable[[], dict[str, torch.Tensor]]:
    import ray

    return lambda: ray.get(session.trainers[0].call.remote(_trainable_cpu))


def compare_datums(session: Any, args: argparse.Namespace) -> list[Datum]:
    """args.compare datums of a 2-turn rollout (every 4th episode: several mazes)."""
    sampler = session.training_client.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    ro = phases.rollout(sampler, phases.Batch(maze(args, 2), eval_set(9, args.mazes), args.group,
                                              params, 7))
    return parity_datums(ro.flat[::4])[:args.compare]


def connect_ray(args: argparse.Namespace) -> None:
    """A local Ray instance (kept for the process) with this process's visible GPUs."""
    from workbench.cluster import connect

    connect("local", num_cpus=args.ray_cpus or None, temp_dir=f"/tmp/ray_gpu_{os.getpid()}")


# ------------------------------------------------------------------------------------ sections


def section_inprocess(args: argparse.Namespace) -> dict[str, Any]:
    args.workers = 1
    session = open_session(make_spec(args, Path(args.workdir) / "inprocess", ClusterSpec()))
    try:
        datums = compare_datums(session, args)
        cmp = compare_update(session, args, datums, lambda: _trainable_cpu(session.host))
        save_share(args, "inprocess_update", cmp | {"datums": datums})
        row = timed_step(session, args, lambda: _captures(session.host))
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else 0
    finally:
        session.close()
    log(step_line("inprocess (1 GPU, one process)", row) + f"; peak {row['peak_gb']:.1f} GB")
    return row


def ray_session(args: argparse.Namespace, workers: int, engines: int, colocate: bool) -> Any:
    connect_ray(args)
    args.workers = workers
    cluster = ClusterSpec("local", num_workers=workers, num_engines=engines,
                          colocate_all=colocate, cpus_per_actor=args.cpus_per_actor)
    start = time.perf_counter()
    session = open_session(make_spec(args, Path(args.workdir) / f"ray{workers}{engines}"
                                     f"{'c' if colocate else 's'}", cluster))
    log(f"ray session {workers} workers + {engines} engines (colocate_all={colocate}) up in "
        f"{time.perf_counter() - start:.1f} s")
    return session


def on_ray(session: Any) -> bool:
    """A Ray session (its actors hold the GPU), not an in-process one (this process does)."""
    return hasattr(session, "memory")


def memory_line(session: Any) -> tuple[str, dict[str, Any]]:
    """Each actor's GPU memory (a Ray session), or this process's and its vLLM's (in-process)."""
    from workbench.cluster.workers import device_memory, vllm_memory

    mem = session.memory() if on_ray(session) else {
        "trainers": [device_memory()], "engines": [vllm_memory(session.host.engine)]}
    parts = [f"{kind[:-1]} {k}: reserved {m.get('reserved', 0) / 1e9:.1f} GB peak "
             f"{m.get('peak', 0) / 1e9:.1f} GB, device used {m.get('device_used', 0) / 1e9:.1f} GB"
             + (f", vLLM budget {m['vllm_budget'] / 1e9:.1f} GB ({m['vllm_utilization']})"
                if "vllm_budget" in m else "")
             for kind in ("trainers", "engines") for k, m in enumerate(mem[kind])]
    return "; ".join(parts), mem


def section_ray1(args: argparse.Namespace) -> dict[str, Any]:
    session = ray_session(args, 1, 1, True)
    try:
        datums = compare_datums(session, args)
        cmp = compare_update(session, args, datums, ray_weights(session))
        save_share(args, "ray1_update", cmp | {"datums": datums})
        row = timed_step(session, args, ray_captures(session))
        row["weight_sync"] = sync_times(session, args, broadcast=False)
        text, row["memory"] = memory_line(session)
    finally:
        session.close()
    log(step_line("ray1 (1 worker + 1 engine, colocated on 1 GPU)", row))
    log(f"ray1 memory: {text}")
    ref = load_share(args, "inprocess_update")
    if ref is not None:  # the in-process run may still be going (parallel): then the summary
        row["vs_inprocess_update"] = compare_records(ref, cmp)
        log(compare_line("ray1 update vs in-process", row["vs_inprocess_update"]))
    return row


def section_ray2_colocated(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    ref = load_share(args, "ray1_update")
    session = ray_session(args, 2, 2, True)
    try:
        row: dict[str, Any] = {}
        if ref is not None:
            got = compare_update(session, args, ref["datums"], ray_weights(session))
            rank1 = ray.get(session.trainers[1].call.remote(_trainable_cpu))
            row["vs_ray1_update"] = compare_records(ref, got)
            row["replicas_identical"] = all(torch.equal(rank1[k], got["after"][k]) for k in rank1)
            log(compare_line("ray2 update vs 1 worker, same datums", row["vs_ray1_update"]) +
                f"; replicas identical {row['replicas_identical']}")
        else:
            log("ray2: no 1-worker update in --share (run ray1 first): agreement not checked")
        row |= timed_step(session, args, ray_captures(session))
        log(step_line("ray2_colocated (2 workers NCCL + 2 engines, 2 GPUs)", row))
        row["weight_sync"] = sync_times(session, args, broadcast=False)
        text, row["memory"] = memory_line(session)
        log(f"ray2 memory: {text}")
    finally:
        session.close()
    return row


def sync_times(session: Any, args: argparse.Namespace, broadcast: bool) -> dict[str, Any]:
    """Median of args.syncs weight syncs through the object store; with broadcast, also over
    the weight-broadcast group (its first sync, which sets NCCL up, reported apart)."""
    tc = session.training_client

    def run(label: str, first_apart: bool) -> dict[str, Any]:
        if first_apart:
            tc.save_weights_and_get_sampling_client()
        for _ in range(args.syncs):
            tc.save_weights_and_get_sampling_client()
        recs = session.syncs[-args.syncs:]
        row = {"median_s": statistics.median(r.seconds for r in recs), "bytes": recs[-1].bytes,
               "engines": recs[-1].engines, "all_s": [r.seconds for r in recs],
               "snapshot_median_s": statistics.median(r.snapshot_seconds for r in recs)}
        if first_apart:
            row["first_s"] = session.syncs[-args.syncs - 1].seconds
        log(f"weight sync {label}: median {row['median_s'] * 1e3:.1f} ms of {args.syncs} "
            f"({row['bytes'] / 1e6:.0f} MB to {row['engines']} engines"
            + (f"; rank 0's copy into the object store {row['snapshot_median_s'] * 1e3:.1f} ms"
               if row["snapshot_median_s"] else "")
            + (f"; first {row['first_s'] * 1e3:.0f} ms" if first_apart else "") + ")")
        return row

    out = {"object_store": run("object store", False)}
    if broadcast:
        try:
            session.open_weight_broadcast()
            out["broadcast"] = run("broadcast (NCCL GPU to GPU; gloo on CPUs)", True)
        except ValueError as err:
            log(f"weight sync broadcast: {err}")
            out["broadcast"] = {"refused": str(err)}
    return out


def section_ray_split(args: argparse.Namespace) -> dict[str, Any]:
    log("ray_split: colocate_all=false gives every actor a whole GPU: on 2 GPUs only 1 worker "
        "+ 1 engine fit (2 workers + 2 engines need 4 GPUs)")
    session = ray_session(args, 1, 1, False)
    try:
        row: dict[str, Any] = {"layout": "1 worker + 1 engine, one GPU each"}
        if "step" in args.split_parts:
            row |= timed_step(session, args, ray_captures(session))
            log(step_line("ray_split (1 worker GPU 0, 1 engine GPU 1)", row))
        row["weight_sync"] = sync_times(session, args, broadcast=True)
        text, row["memory"] = memory_line(session)
        log(f"ray_split memory: {text}")
    finally:
        session.close()
    return row


def section_vllm_actors(args: argparse.Namespace) -> dict[str, Any]:
    """Tiny model, bf16, vLLM engines in --vllm-actors Ray actors (one a GPU), each colocated
    with a trainer."""
    spec = session_spec(apply_overrides(PRESETS["tiny"], [
        "model.name=tiny", "model.device=cuda", "model.dtype=bfloat16", "generator.engine=vllm",
        f"generator.gpu_memory_utilization={args.vllm_share}", "lora.rank=8", "lora.alpha=16",
        "lora.vision=false", "generator.max_tokens=4"]), Path(args.workdir) / "vllm")
    n = args.vllm_actors
    cluster = ClusterSpec("local", num_workers=n, num_engines=n, colocate_all=True,
                          cpus_per_actor=args.cpus_per_actor)
    connect_ray(args)
    start = time.perf_counter()
    session = open_session(replace(spec, cluster=cluster))
    row: dict[str, Any] = {"startup_s": time.perf_counter() - start, "actors": n}
    try:
        args.workers, args.mazes, args.group, args.turns = n, 4, 4, 3
        log(f"vllm_actors: {n} trainers + {n} vLLM engines up in {row['startup_s']:.1f} s")
        step = grpo_step(session, args, seed=0)
        ro = step.pop("rollout")
        row |= step | {"replies": [ep.replies for ep in ro.flat[:2]]}
        text, row["memory"] = memory_line(session)
    finally:
        session.close()
    log(f"vllm_actors: step {row['step_s']:.2f} s (sync {row['handoff_s']:.3f}, rollout "
        f"{row['rollout_s']:.2f}, update {row['update_s']:.2f}); first replies "
        f"{row['replies']}; memory: {text}")
    return row


def pipeline_spec(args: argparse.Namespace, cluster: ClusterSpec) -> SessionSpec:
    """The seed_gpu preset as it is (vLLM with merged weights in a 0.3 share, bf16 LoRA,
    compiled layers, no checkpointing, 4 episodes a call) at this benchmark's sizes."""
    gpu = args.device == "cuda"
    model = args.shape
    if gpu:  # vLLM loads from a folder: the shape's random weights, saved once
        model = save_shape(args.shape, Path(args.workdir) / "pipeline-model")
    config = apply_overrides(PRESETS["seed_gpu"], [
        f"model.name={model}", f"model.device={args.device}",
        f"model.dtype={'bfloat16' if gpu else 'float32'}",
        f"trainer.train_batch_size={args.mazes}", f"generator.n_samples_per_prompt={args.group}",
        f"generator.max_turns={args.turns}", f"generator.max_tokens={args.max_tokens}",
        f"generator.gpu_memory_utilization={args.vllm_share}"]
        + ([] if gpu else ["generator.engine=transformers", "trainer.compile_layers=false",
                           "generator.compile_decode=false"]))
    return replace(session_spec(config, Path(args.workdir) / "pipeline"), cluster=cluster)


def pipelined_steps(session: Any, args: argparse.Namespace, steps: int, ahead: bool
                    ) -> list[dict[str, Any]]:
    """GRPO steps as rl/train.py runs them. ahead=False: sync, rollout, update. ahead=True
    (trainer.off_policy_steps=1): each step takes the rollout the step before started, syncs,
    starts the next rollout from the same weights, and updates while the engine samples it."""
    tc = session.training_client
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    states = eval_set(9, args.mazes)

    def start(sampler: Any, seed: int) -> phases.PendingRollout:
        return phases.start_rollout(sampler, phases.Batch(maze(args), states, args.group, params,
                                                          seed))

    pending, rows = None, []
    device = torch.device("cpu" if on_ray(session) else args.device)  # cpu: no busy figures
    for k in range(steps):
        with GpuBusy(device) as busy:  # in-process only: a Ray driver has no GPU
            t0 = time.perf_counter()
            ro = pending.result() if pending else None
            t1 = time.perf_counter()
            sampler = tc.save_weights_and_get_sampling_client()
            t2 = time.perf_counter()
            ro = ro or start(sampler, k).result()
            t3 = time.perf_counter()
            pending = start(sampler, k + 1) if ahead and k < steps - 1 else None
            outs, opt = update(session, parity_datums(ro.flat), args.minibatch,
                               AdamParams(learning_rate=1e-6))
            t4 = time.perf_counter()
        rows.append({"step_s": t4 - t0, "gpu_busy_s": busy.seconds, "wait_s": t1 - t0,
                     "sync_s": t2 - t1,
                     "rollout_inline_s": t3 - t2, "rollout_s": ro.seconds, "update_s": t4 - t3,
                     "ahead": ahead and k > 0, "started_next": pending is not None,
                     "grad_norm": opt.grad_norm,
                     "kl_sampler_trainer": statistics.mean(
                         o.metrics["kl_sampler_trainer"] for o in outs)})
        r = rows[-1]
        log(f"pipeline {'ahead' if ahead else 'on-policy'} step {k}: {r['step_s']:.2f} s = "
            f"wait {r['wait_s']:.2f} + sync {r['sync_s']:.2f} + rollout {r['rollout_inline_s']:.2f}"
            f" + update {r['update_s']:.2f} (the rollout itself {r['rollout_s']:.2f} s; kl "
            f"{r['kl_sampler_trainer']:.2e}; GPU busy {r['gpu_busy_s']:.2f} s)")
    return rows


def section_pipeline(args: argparse.Namespace) -> dict[str, Any]:
    """trainer.off_policy_steps=1 on one GPU: 1 trainer + 1 engine colocated on Ray, the seed_gpu
    settings (`pipeline_steps`)."""
    connect_ray(args)
    return pipeline_steps(args, "pipeline", "1 trainer + 1 engine", ClusterSpec(
        "local", num_workers=1, num_engines=1, colocate_all=True,
        cpus_per_actor=args.cpus_per_actor))


def section_pipeline_inprocess(args: argparse.Namespace) -> dict[str, Any]:
    """trainer.off_policy_steps=1 in-process, the seed_gpu default: vLLM samples in its own
    process on the session's sampler lane while this process updates (`pipeline_steps`)."""
    return pipeline_steps(args, "pipeline_inprocess", "in-process session", ClusterSpec())


def pipeline_steps(args: argparse.Namespace, name: str, what: str, cluster: ClusterSpec
                   ) -> dict[str, Any]:
    """A warm-up step (the layers compile), --steps on-policy steps, then --steps + 2 steps that
    sample ahead: the first fills the pipeline (nothing ahead yet) and the last drains it (no
    next rollout beside its update), so the --steps between them are the steady state a long
    run sees."""
    start = time.perf_counter()
    session = open_session(pipeline_spec(args, cluster))
    row: dict[str, Any] = {"startup_s": time.perf_counter() - start}
    log(f"{name}: {what} up in {row['startup_s']:.1f} s")
    try:
        row["warmup"] = pipelined_steps(session, args, 1, ahead=False)
        row["on_policy"] = pipelined_steps(session, args, args.steps, ahead=False)
        row["ahead"] = pipelined_steps(session, args, args.steps + 2, ahead=True)
        text, row["memory"] = memory_line(session)
    finally:
        session.close()
    on = statistics.median(r["step_s"] for r in row["on_policy"])
    steady = [r["step_s"] for r in row["ahead"] if r["ahead"] and r["started_next"]]
    ahead = statistics.median(steady)
    row |= {"on_policy_step_s": on, "ahead_step_s": ahead}
    log(f"{name}: median step on-policy {on:.2f} s, one step off-policy {ahead:.2f} s in the "
        f"steady state (each update beside the next rollout; {on / ahead:.2f}x); memory: {text}")
    return row


def section_summary(args: argparse.Namespace) -> dict[str, Any]:
    """The comparisons across sections (run last, after the others wrote ray_gpu.json)."""
    data = json.loads((Path(args.out) / "ray_gpu.json").read_text())
    row: dict[str, Any] = {}
    a, b = data.get("inprocess", {}), data.get("ray1", {})
    if "step_s" in a and "step_s" in b:
        row["ray_overhead"] = b["step_s"] / a["step_s"] - 1
        row["ray_overhead_net"] = b["step_net_s"] / a["step_net_s"] - 1
        log(f"summary: Ray overhead (ray1 / inprocess - 1) {100 * row['ray_overhead']:+.1f}% "
            f"({100 * row['ray_overhead_net']:+.1f}% net of graph captures; goal <= 10%)")
    ref, got = load_share(args, "inprocess_update"), load_share(args, "ray1_update")
    if ref is not None and got is not None:
        row["ray1_vs_inprocess_update"] = compare_records(ref, got)
        log(compare_line("summary: ray1 update vs in-process", row["ray1_vs_inprocess_update"]))
    c = data.get("ray2_colocated", {})
    if "step_s" in c and "step_s" in b:
        row["ray2_speedup"] = b["step_s"] / c["step_s"]
        log(f"summary: 2 workers + 2 engines: {row['ray2_speedup']:.2f}x the 1+1 step")
    return row


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "inprocess": section_inprocess, "ray1": section_ray1,
    "ray2_colocated": section_ray2_colocated, "ray_split": section_ray_split,
    "vllm_actors": section_vllm_actors, "pipeline": section_pipeline,
    "pipeline_inprocess": section_pipeline_inprocess,
    "summary": section_summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="inprocess,ray1,ray2_colocated,ray_split,summary")
    ap.add_argument("--shape", default="qwen3-vl-8b-shape", help="model.name (tiny on CPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="/tmp/ray_gpu")
    ap.add_argument("--share", default="/tmp/ray_gpu_share", help="datums and updates handed "
                    "between section processes")
    ap.add_argument("--workdir", default="/tmp/ray_gpu_work")
    ap.add_argument("--deadline-at", type=float, default=0.0,
                    help="epoch seconds after which remaining sections are skipped (0: none)")
    ap.add_argument("--mazes", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--minibatch", type=int, default=8, help="datums a forward (per worker)")
    ap.add_argument("--compare", type=int, default=16, help="datums of the agreement update")
    ap.add_argument("--kv-tokens", type=int, default=3072)
    ap.add_argument("--engine-share", type=float, default=0.5, help="generator."
                    "gpu_memory_utilization of the transformers engines")
    ap.add_argument("--vllm-share", type=float, default=0.3)
    ap.add_argument("--vllm-actors", type=int, default=2, help="vllm_actors: engines (and "
                    "trainers beside them), one a GPU")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="pipeline: timed steps of each kind")
    ap.add_argument("--split-parts", default="step,sync", help="ray_split: step and/or sync")
    ap.add_argument("--cpus-per-actor", type=float, default=2.0)
    ap.add_argument("--ray-cpus", type=int, default=0, help="0: all")
    ap.add_argument("--small", action="store_true", help="CPU dry run sizes")
    args = ap.parse_args()
    if args.small:
        args.mazes, args.group, args.turns, args.max_tokens = 2, 2, 3, 2
        args.minibatch, args.compare, args.kv_tokens = 2, 4, 512
    args.workers = 1
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    for name in args.sections.split(","):
        if args.deadline_at and time.time() > args.deadline_at:
            log(f"{name}: skipped, the deadline has passed")
            record(out, name, {"skipped": "deadline"})
            continue
        log(f"{name}: start")
        try:
            row = SECTIONS[name](args)
        except Exception as err:  # one section's failure must not cost the others
            log(f"{name}: FAILED {type(err).__name__}: {str(err)[:800]}")
            row = {"failed": f"{type(err).__name__}: {str(err)[:2000]}"}
        record(out, name, row | {"seconds": time.time() - T0})
    from workbench.cluster import disconnect

    disconnect()


if __name__ == "__main__":
    main()
