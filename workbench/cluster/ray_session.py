"""The training-session primitives on Ray actors: the in-process `Session` surface, scaled out.

    connect("local", num_cpus=2)
    session = create_ray_session(SessionSpec(model="tiny", lora=LoraSettings(rank=8),
                                             cluster=ClusterSpec("local", num_workers=2,
                                                                 num_engines=2)))
    tc = session.training_client                 # session.clients, over this executor
    fb = tc.forward_backward(datums, "ppo")      # a concurrent.futures.Future, as in-process
    opt = tc.optim_step(AdamParams(learning_rate=3e-4))
    sampler = tc.save_weights_and_get_sampling_client()   # weights reach every engine first
    session.open_weight_broadcast()   # optional: later syncs are one NCCL/gloo broadcast
    sampler.play(play_episodes, maze_cfg, states_P, 8, SamplingParams(), seed=0).result()

Every actor builds its host from the same `SessionSpec` an in-process session is built from.

`RaySession` is the clients' `Executor`. Trainer calls go to every worker (forward_backward on a
slice of the datums each, the outputs merged; optim_step and load_state on all, the gradients
summed over the workers first) or to rank 0 (save_state, exports: the replicas are identical).
Sampling calls go to engine 0, a rollout's initial states are split over the engines. Each
actor runs one call at a time in the order this session submitted them, so training calls keep
submission order. Futures wrap Ray object refs; a call spread over several actors gives one
future that fails as soon as any actor fails (e.g. `ray.exceptions.ActorDiedError`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from workbench.cluster.parallel import merge_outputs, padded_shards, split_B
from workbench.cluster.placement import (
    PlacementPlan,
    actor_options,
    create_placement_group,
    plan_placement,
)
from workbench.cluster.weight_sync import check_distinct_gpus
from workbench.cluster.workers import SamplerEngine, TrainerWorker
from workbench.deps import require
from workbench.session import host
from workbench.session.clients import Call, TrainingClient
from workbench.session.spec import SessionSpec
from workbench.session.types import Datum, ForwardBackwardOutput


def gather(refs: list, combine: Callable[[list], Any]) -> Future:
    """One Future for several object refs: combine(results in ref order), or the first error."""
    out: Future = Future()
    results: list[Any] = [None] * len(refs)
    pending, lock = [len(refs)], threading.Lock()

    def done(i: int, fut: Future) -> None:
        with lock:
            if out.done():
                return
            if fut.exception() is not None:
                out.set_exception(fut.exception())
                return
            results[i], pending[0] = fut.result(), pending[0] - 1
            if pending[0] == 0:
                try:
                    out.set_result(combine(results))
                except Exception as err:  # a bad merge surfaces through the future
                    out.set_exception(err)

    for i, ref in enumerate(refs):
        ref.future().add_done_callback(lambda fut, i=i: done(i, fut))
    if not refs:
        out.set_result(combine([]))
    return out


def chunk_seed(seed: int, k: int) -> int:
    """Sampling seed of engine chunk k: chunk 0 keeps `seed` (one engine = in-process)."""
    return seed if k == 0 else int(np.random.SeedSequence([seed, k]).generate_state(1)[0])


@dataclass(frozen=True)
class SyncRecord:
    """One weight sync from trainer rank 0 to every sampler engine."""

    version: int
    seconds: float  # snapshot on the trainer + transfer + load on the engines
    bytes: int  # bytes sent to each engine (colocated merged: the merged weights)
    engines: int
    method: str = "object_store"  # object_store | broadcast | colocated (see RaySession)
    snapshot_seconds: float = 0.0  # object_store: until rank 0's copy is in the object store


def handoff_kind(spec: SessionSpec) -> str:
    """How a trainer worker hands a weights version to the engine colocated on its GPU
    (`TrainerWorker.hand_version`), or "" when engines are sent versions through the object
    store: colocated (cluster.colocate_all), at most one engine per trainer, replicas whole
    (strategy ddp: an fsdp worker holds a shard of the base). "merged" (vLLM, vllm_lora=merged:
    the engine holds no copy of the model), "adapter" (vLLM: no copy either), "factors" (our
    engine, which samples from a model of its own)."""
    c = spec.cluster
    if not (c.colocate_all and c.num_engines <= c.num_workers and c.strategy == "ddp"):
        return ""
    if spec.engine.name == "vllm":
        return spec.engine.vllm_lora
    return "factors"


class RaySession:
    """Trainer workers + sampler engines in one placement group; `close()` releases them. It is
    the clients' `Executor`: N data-parallel trainer replicas, M sampler engines. A weight sync
    reaches the engines one of three ways (`SyncRecord.method`): colocated - trainer k hands
    its version to engine k on the same GPU (`handoff_kind`: CUDA IPC handles or an adapter
    folder, nothing through the object store); object_store - rank 0's tensors copied to the
    CPU, through Ray's object store, onto each engine; broadcast - after
    `open_weight_broadcast`, one NCCL (gloo) broadcast from rank 0."""

    def __init__(self, trainers: list, engines: list, placement_group: Any, plan: PlacementPlan,
                 spec: SessionSpec, info: dict[str, Any], names: list[str]) -> None:
        ray = require("ray")
        self.spec = spec
        self.trainers, self.engines, self.placement_group = trainers, engines, placement_group
        self.plan, self.strategy, self.actor_names = plan, spec.cluster.strategy, names
        self._workdir, self._info = Path(spec.workdir), info
        self.trainable_bytes = int(info.pop("trainable_bytes"))
        self.syncs: list[SyncRecord] = []  # every weight sync, newest last
        self.weight_broadcast = False  # True after open_weight_broadcast()
        self.handoff = handoff_kind(spec)  # "": engines are sent versions by rank 0
        self.recoverable_errors = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)
        self.training_client = TrainingClient(self)

    def submit(self, fn: Call, *args: Any) -> Future:
        """fn(host, *args) on trainer rank 0 (saves, exports: the replicas are identical)."""
        return self.trainers[0].call.remote(fn, *args).future()

    def submit_all(self, fn: Call, *args: Any) -> Future:
        """fn(host, *args) on every trainer worker -> rank 0's result."""
        return gather([w.call.remote(fn, *args) for w in self.trainers], lambda r: r[0])

    def submit_batch(self, fn: Call, datums: list[Datum], *args: Any) -> Future:
        """fn(host, shard, *args) on every worker's contiguous slice of the datums (fsdp's
        collectives need every worker to run a forward: an empty slice gets a zero-weight
        datum) -> forward outputs merged as one worker returns them (parallel.merge_outputs),
        any other result rank 0's."""
        if self.strategy == "fsdp":
            shards, sizes = padded_shards(datums, len(self.trainers))
        else:
            shards = split_B(datums, len(self.trainers))
            sizes = [len(s) for s in shards]
        refs = [w.call.remote(fn, s, *args) for w, s in zip(self.trainers, shards)]
        return gather(refs, lambda outs: merge_outputs(outs, sizes)
                      if isinstance(outs[0], ForwardBackwardOutput) else outs[0])

    def submit_sampling(self, fn: Call, *args: Any, model: bool = False) -> Future:
        """fn(host, *args) on engine 0; model (fn runs the policy's own forward, e.g.
        compute_logprobs): on trainer rank 0, which keeps every version it synced, in order
        with the training calls, as in-process (a vLLM engine may hold no model)."""
        if model:
            return self.trainers[0].call.remote(fn, *args).future()
        return self.engines[0].call.remote(fn, *args).future()

    def submit_spread(self, fn: Call, items: list[Any], *args: Any, seed: int) -> Future:
        """fn(host, chunk, *args, chunk_seed(seed, k)) on engine k, the items split into
        contiguous chunks -> the engines' lists concatenated in item order."""
        chunks = split_B(list(items), len(self.engines))
        refs = [e.call.remote(fn, chunk, *args, chunk_seed(seed, k))
                for k, (e, chunk) in enumerate(zip(self.engines, chunks)) if chunk]
        return gather(refs, lambda parts: [x for part in parts for x in part])

    def sync_weights(self) -> int:
        """Send rank 0's current weights to every engine (through the object store, or one
        broadcast after open_weight_broadcast) -> their version; `syncs` records it."""
        ray = require("ray")
        if not self.engines:
            raise ValueError("this session has no sampler engines (num_engines=0)")
        start, rank0 = time.perf_counter(), self.trainers[0]
        if self.weight_broadcast:
            version = ray.get(rank0.weights_version.remote())  # after the queued optim_steps
            sent = rank0.send_weights.remote()
            ray.get([e.receive_weights.remote(version) for e in self.engines] + [sent])
            self.syncs.append(SyncRecord(version, time.perf_counter() - start, ray.get(sent),
                                         len(self.engines), "broadcast"))
            return version
        if self.handoff:
            handed = ray.get([t.hand_version.remote(e, self.handoff)
                              for t, e in zip(self.trainers, self.engines)])
            self.syncs.append(SyncRecord(handed[0][0], time.perf_counter() - start,
                                         handed[0][1], len(handed), "colocated"))
            return handed[0][0]
        snapshot = rank0.snapshot.remote()
        ray.wait([snapshot], fetch_local=False)  # in the object store: the trainer's part
        stored = time.perf_counter() - start
        versions = ray.get([e.install.remote(snapshot) for e in self.engines])
        self.syncs.append(SyncRecord(versions[0], time.perf_counter() - start,
                                     self.trainable_bytes, len(versions), "object_store", stored))
        return versions[0]

    @property
    def overlaps_sampling(self) -> bool:
        """Always: engines sample in actors of their own, beside the trainers."""
        return True

    @property
    def workdir(self) -> Path:
        return self._workdir

    def describe(self) -> dict[str, Any]:
        """Model source, base hash, LoRA settings, and the Ray layout (for manifests)."""
        return dict(self._info)

    def open_weight_broadcast(self) -> None:
        """From now on a weight sync is one broadcast of rank 0's trainable tensors over a
        process group of rank 0 and the engines (NCCL on GPUs, gloo on CPUs; see
        cluster/weight_sync.py) instead of a copy through the object store."""
        ray = require("ray")
        if not self.engines:
            raise ValueError("this session has no sampler engines (num_engines=0)")
        gpus = ray.get([a.memory.remote() for a in [self.trainers[0], *self.engines]])
        check_distinct_gpus(gpus[0].get("gpu", ""), [g.get("gpu", "") for g in gpus[1:]])
        world = 1 + len(self.engines)
        address, port = ray.get(self.trainers[0].open_weight_store.remote(world))
        ray.get([self.trainers[0].join_weight_group.remote(world)] +
                [e.join_weight_group.remote(address, port, k + 1, world)
                 for k, e in enumerate(self.engines)])
        self.weight_broadcast = True

    def memory(self) -> dict[str, list[dict[str, Any]]]:
        """GPU memory of every trainer and engine actor (cluster.workers.device_memory), by
        kind: {"trainers": [...], "engines": [...]} ({} entries on CPUs)."""
        ray = require("ray")
        trainers = ray.get([t.memory.remote() for t in self.trainers])
        return {"trainers": trainers, "engines": ray.get([e.memory.remote() for e in self.engines])}

    def speed_metrics(self) -> Future:
        """`speed/*` of the sampler engines and the trainer workers (a fast path counts as
        running when it runs on every actor of its side), and `memory/gpu_peak_gb` summed over
        every actor -> Future[dict]."""
        refs = [e.call.remote(host.sampler_metrics) for e in self.engines] + \
            [t.call.remote(host.trainer_metrics) for t in self.trainers]
        return gather(refs, merge_speed_metrics)

    def report_metrics(self, row: dict[str, Any], run: str) -> Future:
        """A metrics row to Ray's metrics, from trainer worker 0 (see cluster/metrics.py)."""
        return self.trainers[0].report_metrics.remote(row, run).future()

    def close(self) -> None:
        """Kill the actors and free their bundles (safe to call twice, or after a failure)."""
        release(self.trainers + self.engines, self.placement_group)
        self.trainers, self.engines, self.placement_group = [], [], None


def merge_speed_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """The engines' speed metrics as one row: a `speed/*` fast path runs when it runs on every
    engine (min); vLLM's prefix-cache tokens add up, its hit rate is their weighted mean, the
    seconds inside vLLM's calls are the longest engine's (they run side by side), and the
    streamed requests (and those rendered whole) and the actors' GPU memory peaks add up."""
    out = {k: min(r.get(k, 1.0) for r in rows)
           for k in {k for r in rows for k in r} if k.startswith("speed/")}
    queried = [r.get("vllm/prefix_cache_queried_tokens", 0.0) for r in rows]
    if any("vllm/prefix_cache_hit_rate" in r for r in rows):
        total = sum(queried)
        hits = sum(q * r.get("vllm/prefix_cache_hit_rate", 0.0) for q, r in zip(queried, rows))
        out["vllm/prefix_cache_queried_tokens"] = total
        out["vllm/prefix_cache_hit_rate"] = hits / total if total else 0.0
    if any("vllm/generate_s" in r for r in rows):
        out["vllm/generate_s"] = max(r.get("vllm/generate_s", 0.0) for r in rows)
    for key in ("vllm/requests", "vllm/requests_rendered_whole", "memory/gpu_peak_gb"):
        if any(key in r for r in rows):
            out[key] = sum(r.get(key, 0.0) for r in rows)
    return out


def engine_spec(spec: SessionSpec) -> SessionSpec:
    """The spec each of M engines is built from: a rollout's rows are split over the engines,
    so each one's CUDA-graph KV pool is sized for ceil(kv_rows / M) rows (grown if exceeded)."""
    engines = max(spec.cluster.num_engines, 1)
    rows = -(-spec.engine.kv_rows // engines)
    return replace(spec, engine=replace(spec.engine, kv_rows=rows))


def create_ray_session(spec: SessionSpec) -> RaySession:
    """Start spec.cluster.num_workers trainer workers and num_engines sampler engines on the
    connected Ray cluster, each building its host from `spec` (threads_per_actor: torch threads
    in each; 0 = Ray's default, its CPU share, at least 1)."""
    ray = require("ray")
    if not ray.is_initialized():
        raise RuntimeError("not connected to Ray: call workbench.cluster.connect(...) first")
    c = spec.cluster
    if c.strategy == "fsdp" and (spec.lora is None or not spec.device.startswith("cuda")):
        raise ValueError("strategy fsdp shards the frozen base under LoRA on GPUs: it needs "
                         "LoRA and device cuda (use ddp otherwise)")
    plan = plan_placement(c.num_workers, c.num_engines, c.colocate_all,
                          spec.device.startswith("cuda"), c.cpus_per_actor)
    pg = create_placement_group(plan)
    prefix = f"workbench-{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}/trainer-{r}" for r in range(c.num_workers)] + \
        [f"{prefix}/engine-{k}" for k in range(c.num_engines)]
    trainer_cls = ray.remote(max_concurrency=1, max_restarts=0)(TrainerWorker)
    engine_cls = ray.remote(max_concurrency=1, max_restarts=0)(SamplerEngine)
    trainers = [trainer_cls.options(name=names[r], **actor_options(plan, pg, "trainer", r))
                .remote(spec, r) for r in range(c.num_workers)]
    # A vLLM engine handed its versions by its trainer holds no copy of the model. Our engine
    # on a GPU starts once the trainers have their models, so that its size check
    # (workers.check_sampler_memory) sees what they leave; vLLM checks its own share.
    handoff = handoff_kind(spec)
    weights = handoff not in ("merged", "adapter")
    engines: list = []
    try:
        if spec.engine.name == "transformers" and spec.device.startswith("cuda"):
            ray.get([t.pid.remote() for t in trainers])
        engines = [engine_cls.options(name=names[c.num_workers + k],
                                      **actor_options(plan, pg, "engine", k))
                   .remote(engine_spec(spec), weights) for k in range(c.num_engines)]
        if c.num_workers > 1:
            address, port = ray.get(trainers[0].open_store.remote())
            ray.get([w.join.remote(address, port) for w in trainers])
        info = ray.get(trainers[0].call.remote(host.describe_host)) | {
            "trainable_bytes": ray.get(trainers[0].call.remote(host.trainable_bytes)),
            "backend": {"kind": "ray", "num_workers": c.num_workers,
                        "num_engines": c.num_engines, "colocate_all": c.colocate_all,
                        "strategy": c.strategy,
                        "weight_sync": f"colocated:{handoff}" if handoff else "object_store"}}
        ray.get([e.pid.remote() for e in engines])  # engines loaded (or their error raised)
    except BaseException:
        release(trainers + engines, pg)
        raise
    return RaySession(trainers, engines, pg, plan, spec, info, names)


def release(actors: list, placement_group: Any) -> None:
    """Kill actors (no restart) and remove their placement group."""
    ray = require("ray")
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        ray.kill(actor, no_restart=True)
    if placement_group is not None:
        remove_placement_group(placement_group)
