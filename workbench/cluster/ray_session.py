"""The training-session primitives on Ray actors: the in-process `Session` surface, scaled out.

    connect("local", num_cpus=2)
    session = create_ray_session(SessionSpec(model="tiny", lora=LoraSettings(rank=8),
                                             cluster=ClusterSpec("local", num_workers=2,
                                                                 num_engines=2)))
    tc = session.training_client
    fb = tc.forward_backward(datums, "ppo")      # a concurrent.futures.Future, as in-process
    opt = tc.optim_step(AdamParams(learning_rate=3e-4))
    sampler = tc.save_weights_and_get_sampling_client()   # weights reach every engine first
    session.open_weight_broadcast()   # optional: later syncs are one NCCL/gloo broadcast
    sampler.play(play_episodes, maze_cfg, states_P, 8, SamplingParams(), seed=0).result()

Every actor builds its host from the same `SessionSpec` an in-process session is built from.

Trainer calls go to every worker (forward_backward on a slice of the datums each, optim_step and
load_state on all) or to rank 0 (save_state, exports: the replicas are identical). Each actor
runs one call at a time in the order this client submitted them, so training calls keep
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
from workbench.policy import SamplingParams, Stream
from workbench.session import checkpoint, host
from workbench.session.host import EpisodeLoop
from workbench.session.losses import LossConfig
from workbench.session.spec import SessionSpec
from workbench.session.types import AdamParams, Datum


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
    bytes: int  # size of the trainable tensors sent
    engines: int
    method: str = "object_store"  # object_store | broadcast (RaySession.open_weight_broadcast)
    snapshot_seconds: float = 0.0  # object_store: until rank 0's copy is in the object store


class RaySamplingClient:
    """Samples from one weights version, installed on every sampler engine."""

    def __init__(self, session: RaySession, sync: SyncRecord) -> None:
        self._session, self.sync = session, sync
        self.version = sync.version

    def sample(self, prompt: Stream, num_samples: int, sampling_params: SamplingParams,
               seed: int = 0) -> Future:
        """num_samples replies to `prompt` (engine 0) -> Future[SampleResponse]."""
        engine = self._session.engines[0]
        return engine.sample.remote(self.version, prompt, num_samples, sampling_params,
                                    seed).future()

    def compute_logprobs(self, prompt: Stream, temperature: float = 1.0) -> Future:
        """Per-token log-probs of the prompt's own tokens (engine 0) -> Future[list[float]]."""
        engine = self._session.engines[0]
        return engine.compute_logprobs.remote(self.version, prompt, temperature).future()

    def play(self, loop: EpisodeLoop, task: Any, init_states_P: list[Any], n: int,
             params: SamplingParams, seed: int) -> Future:
        """loop(...) on the engines, the initial states split over them (chunk k sampled with
        `chunk_seed(seed, k)`) -> Future[episodes_P_G]."""
        engines = self._session.engines
        chunks = split_B(list(init_states_P), len(engines))
        refs = [e.play.remote(self.version, loop, task, chunk, n, params, chunk_seed(seed, k))
                for k, (e, chunk) in enumerate(zip(engines, chunks)) if chunk]
        return gather(refs, lambda parts: [group for part in parts for group in part])


class RayTrainingClient:
    """The trainer side: N data-parallel workers, rank 0 canonical for saves and exports."""

    def __init__(self, session: RaySession) -> None:
        self._session = session
        self._processor: Any = None

    @property
    def _workers(self) -> list:
        return self._session.trainers

    def _shards(self, datums: list[Datum]) -> tuple[list[list[Datum]], list[int]]:
        """Each worker's slice of the datums and its real size (fsdp's collectives need every
        worker to run a forward: an empty slice gets a zero-weight datum)."""
        if self._session.strategy == "fsdp":
            return padded_shards(datums, len(self._workers))
        shards = split_B(datums, len(self._workers))
        return shards, [len(s) for s in shards]

    def _spread(self, datums: list[Datum], loss_fn: str, cfg: LossConfig,
                backward: bool) -> Future:
        shards, sizes = self._shards(datums)
        refs = [w.forward.remote(s, loss_fn, cfg, backward) for w, s in zip(self._workers, shards)]
        return gather(refs, lambda outs: merge_outputs(outs, sizes))

    def _rank0_path(self, fn: Callable[..., Any], *args: Any) -> Future:
        """fn(host, *args) on rank 0, whose result is a folder -> Future[str]."""
        return gather([self._workers[0].call.remote(fn, *args)], lambda r: str(r[0]))

    def _all(self, fn: Callable[..., Any], *args: Any) -> Future:
        return gather([w.call.remote(fn, *args) for w in self._workers], lambda r: r[0])

    def forward(self, datums: list[Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: LossConfig | None = None) -> Future:
        """Loss and trainer log-probs without gradients -> Future[ForwardBackwardOutput]."""
        host.warn_if_empty("forward", datums)
        return self._spread(datums, loss_fn, loss_fn_config or LossConfig(), backward=False)

    def forward_backward(self, datums: list[Datum], loss_fn: str,
                         loss_fn_config: LossConfig | None = None) -> Future:
        """Accumulate gradients of the loss on each worker's slice -> Future[...Output]."""
        host.warn_if_empty("forward_backward", datums)
        return self._spread(datums, loss_fn, loss_fn_config or LossConfig(), backward=True)

    def optim_step(self, adam: AdamParams) -> Future:
        """All-reduce the gradients, clip, step AdamW on every worker -> Future[OptimStepOutput]."""
        return gather([w.optim_step.remote(adam) for w in self._workers], lambda r: r[0])

    def save_state(self, name: str) -> Future:
        """Weights + optimiser to workdir/states/<name> (rank 0, atomic) -> Future[path]."""
        return self.save_state_to(self._session.workdir / "states" / name)

    def save_state_to(self, folder: str | Path) -> Future:
        """Weights + optimiser to an explicit folder (rank 0, atomic) -> Future[path]."""
        return self._rank0_path(checkpoint.save_state, Path(folder))

    def load_state(self, path: str | Path, with_optimizer: bool = True) -> Future:
        """Every worker restores weights (and optimiser) from a saved state -> Future[None]."""
        return self._all(checkpoint.load_state, Path(path), with_optimizer)

    def load_adapter(self, folder: str | Path) -> Future:
        """Every worker loads an exported PEFT adapter (same base only) -> Future[None]."""
        return self._all(checkpoint.load_adapter_weights, Path(folder))

    def save_weights_for_sampler(self, name: str) -> Future:
        """Export the adapter to workdir/sampler_weights/<name> (rank 0) -> Future[path]."""
        return self.export_adapter(self._session.workdir / "sampler_weights" / name)

    def export_adapter(self, folder: str | Path) -> Future:
        """Export the adapter in PEFT format to `folder` (rank 0) -> Future[path]."""
        return self._rank0_path(checkpoint.export_adapter, Path(folder))

    def export_model(self, folder: str | Path) -> Future:
        """A complete checkpoint folder (LoRA merged in; rank 0) -> Future[path]."""
        if self._session.strategy == "fsdp":
            raise NotImplementedError("export_model under fsdp: export the adapter and merge it "
                                      "into the base on one device (load_model + load_adapter)")
        return self._rank0_path(checkpoint.export_model, Path(folder))

    def save_weights_and_get_sampling_client(self) -> RaySamplingClient:
        """Send rank 0's current weights to every engine; the client samples that version."""
        ray = require("ray")
        if not self._session.engines:
            raise ValueError("this session has no sampler engines (num_engines=0)")
        if self._session.weight_broadcast:
            return self._broadcast_weights()
        start = time.perf_counter()
        snapshot = self._workers[0].snapshot.remote()
        ray.wait([snapshot], fetch_local=False)  # in the object store: the trainer's part
        stored = time.perf_counter() - start
        versions = ray.get([e.install.remote(snapshot) for e in self._session.engines])
        seconds = time.perf_counter() - start
        sync = SyncRecord(versions[0], seconds, self._session.trainable_bytes, len(versions),
                          "object_store", stored)
        self._session.syncs.append(sync)
        return RaySamplingClient(self._session, sync)

    def _broadcast_weights(self) -> RaySamplingClient:
        """The sync as one broadcast from rank 0 over the weight group (open_weight_broadcast)."""
        ray = require("ray")
        start = time.perf_counter()
        rank0, engines = self._workers[0], self._session.engines
        version = ray.get(rank0.weights_version.remote())  # after the queued optim_steps
        sent = rank0.send_weights.remote()
        ray.get([e.receive_weights.remote(version) for e in engines] + [sent])
        sync = SyncRecord(version, time.perf_counter() - start, ray.get(sent), len(engines),
                          "broadcast")
        self._session.syncs.append(sync)
        return RaySamplingClient(self._session, sync)

    def grad_squares(self, datums: list[Datum], loss_fn: str,
                     loss_fn_config: LossConfig | None = None) -> Future:
        """Squared gradient norm per parameter for these datums (every worker's slice, summed
        over the workers), without stepping -> Future[dict[str, float]] (rank 0's)."""
        cfg = loss_fn_config or LossConfig()
        shards, _ = self._shards(datums)
        refs = [w.grad_squares.remote(s, loss_fn, cfg) for w, s in zip(self._workers, shards)]
        return gather(refs, lambda r: r[0])

    def get_processor(self) -> Any:
        """The policy's processor (tokenizer + image processor), fetched once from rank 0."""
        if self._processor is None:
            self._processor = self._workers[0].call.remote(_processor_of).future().result()
        return self._processor

    def get_tokenizer(self) -> Any:
        """The policy's tokenizer."""
        return self.get_processor().tokenizer


def _processor_of(host: Any) -> Any:
    return host.lm.processor


class RaySession:
    """Trainer workers + sampler engines in one placement group; `close()` releases them."""

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
        self.recoverable_errors = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)
        self.training_client = RayTrainingClient(self)

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
        """`speed/*` of the sampler engines (a fast path counts as running when it runs on
        every engine) -> Future[dict[str, float]]."""
        refs = [e.speed_metrics.remote() for e in self.engines]
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
    engine (min); vLLM's prefix-cache tokens add up, its hit rate is their weighted mean, and
    the seconds inside vLLM's generate are the longest engine's (they run side by side)."""
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
    return out


def engine_spec(spec: SessionSpec) -> SessionSpec:
    """The spec each of M engines is built from: a rollout's rows are split over the engines,
    so each one's CUDA-graph KV pool is sized for ceil(kv_rows / M) rows (grown if exceeded)."""
    engines = max(spec.cluster.num_engines, 1)
    rows = -(-spec.speed.kv_rows // engines)
    return replace(spec, speed=replace(spec.speed, kv_rows=rows))


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
    engines = [engine_cls.options(name=names[c.num_workers + k],
                                  **actor_options(plan, pg, "engine", k)).remote(engine_spec(spec))
               for k in range(c.num_engines)]
    try:
        if c.num_workers > 1:
            address, port = ray.get(trainers[0].open_store.remote())
            ray.get([w.join.remote(address, port) for w in trainers])
        info = ray.get(trainers[0].call.remote(host.describe_host)) | {
            "trainable_bytes": ray.get(trainers[0].call.remote(host.trainable_bytes)),
            "backend": {"kind": "ray", "num_workers": c.num_workers,
                        "num_engines": c.num_engines, "colocate_all": c.colocate_all,
                        "strategy": c.strategy}}
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
