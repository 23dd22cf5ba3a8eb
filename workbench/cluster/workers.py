"""The two Ray actor kinds, as plain classes (`ray.remote` wraps them when a session starts).

Both build their `ModelHost` from the session's `SessionSpec` (`session.host.make_host`), so an
actor honours exactly what an in-process session honours (dtype, device, engine, speed).

TrainerWorker: one data-parallel replica of the policy and its optimiser. It runs the host
functions (`forward`, `optim_step`, the checkpoint functions) on its host; with N > 1 workers
they form a torch.distributed group (gloo on CPU, NCCL on CUDA) whose rendezvous is a TCPStore
that rank 0 opens on a free port of its node.

SamplerEngine: its own copy of the base model (+ LoRA), the sampler weight versions it has been
sent, the sampler engine that draws the tokens (generator.engine: transformers, or vLLM loading
each version's adapter), and the episode loop it is handed (`host.play`) beside it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from workbench.cluster.metrics import GaugeSet
from workbench.cluster.parallel import all_reduce_grads, empty_output, shard_frozen_base
from workbench.policy import SamplingParams, Stream
from workbench.session import host
from workbench.session.host import EpisodeLoop, ModelHost
from workbench.session.losses import LossConfig
from workbench.session.spec import SessionSpec
from workbench.session.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepOutput

GROUP_TIMEOUT = timedelta(minutes=10)  # a collective waiting longer than this fails


def set_threads(threads: int) -> None:
    """torch's CPU threads in this actor (0: keep Ray's OMP_NUM_THREADS, its CPU share >= 1)."""
    if threads > 0:
        torch.set_num_threads(threads)


class TrainerWorker:
    """Rank `rank` of `world_size` data-parallel trainers."""

    def __init__(self, spec: SessionSpec, rank: int) -> None:
        set_threads(spec.cluster.threads_per_actor)
        self.host = host.make_host(spec, sampler=False)
        self.rank, self.world_size = rank, spec.cluster.num_workers
        self.strategy = spec.cluster.strategy
        self.store: Any = None
        self.gauges = GaugeSet()

    def open_store(self, address: str = "") -> tuple[str, int]:
        """Rank 0: a TCPStore on a free port of this node (Ray's address for it unless given)
        -> (address, port) for the others."""
        from torch.distributed import TCPStore

        if not address:
            import ray

            address = ray.util.get_node_ip_address()
        self.store = TCPStore(address, 0, self.world_size, is_master=True,
                              wait_for_workers=False, timeout=GROUP_TIMEOUT)
        return address, self.store.port

    def join(self, address: str, port: int) -> None:
        """Join the process group (all ranks at once); fsdp then shards the frozen base."""
        import torch.distributed as dist
        from torch.distributed import TCPStore

        store = self.store or TCPStore(address, port, self.world_size, is_master=False,
                                       timeout=GROUP_TIMEOUT)
        backend = "nccl" if self.host.lm.model.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank,
                                world_size=self.world_size, timeout=GROUP_TIMEOUT)
        if self.strategy == "fsdp":
            shard_frozen_base(self.host.lm.model, list(self.host.trainable().values()))

    def forward(self, datums: list[Datum], loss_fn: str, cfg: LossConfig,
                backward: bool) -> ForwardBackwardOutput:
        """This worker's slice: loss, metrics, log-probs (and summed gradients if backward)."""
        if not datums:
            return empty_output()
        return host.forward(self.host, datums, loss_fn, cfg, backward)

    def optim_step(self, adam: AdamParams) -> OptimStepOutput:
        """All-reduce (SUM) the gradients over the workers, then the same step everywhere."""
        self._all_reduce()
        return host.optim_step(self.host, adam)

    def _all_reduce(self) -> None:
        if self.world_size > 1:
            host.trainer_weights(self.host)
            all_reduce_grads(list(self.host.trainable().values()))

    def grad_squares(self, datums: list[Datum], loss_fn: str,
                     cfg: LossConfig) -> dict[str, float]:
        """Squared gradient norm per parameter of the whole batch (every worker's slice summed),
        without stepping; the gradients are dropped afterwards."""
        if datums:
            host.forward(self.host, datums, loss_fn, cfg, backward=True)
        self._all_reduce()
        squares = host.grad_squares(self.host)
        host.zero_grads(self.host)
        return squares

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(weights version, trainable tensors on CPU) for the sampler engines."""
        host.trainer_weights(self.host)
        return self.host.weights_id, {k: v.cpu() for k, v in host.snapshot(self.host).items()}

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(host, *args): the checkpoint functions, describe_host, ..."""
        return fn(self.host, *args)

    def report_metrics(self, row: dict[str, Any], run: str) -> int:
        """A step's metrics row to Ray's metrics (gauges tagged with the run's name)."""
        return self.gauges.record(row, run)

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> int:
        """torch's CPU threads in this actor."""
        return torch.get_num_threads()

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class SamplerEngine:
    """A sampler: base model (+ LoRA) and the weight versions the trainer sent it."""

    def __init__(self, spec: SessionSpec) -> None:
        set_threads(spec.cluster.threads_per_actor)
        if spec.device.startswith("cuda") and spec.engine.name == "transformers":
            # keep to its GPU share (vLLM does that itself)
            torch.cuda.set_per_process_memory_fraction(spec.engine.gpu_memory_utilization)
        self.host: ModelHost = host.make_host(spec, trainer=False)

    def install(self, snapshot: tuple[int, dict[str, torch.Tensor]]) -> int:
        """Load a trainer snapshot as sampler version `snapshot[0]`; returns it."""
        version, tensors = snapshot
        host.install_version(self.host, version, tensors)
        return version

    def sample(self, version: int, prompt: Stream, n: int, params: SamplingParams,
               seed: int) -> Any:
        host.use_version(self.host, version)
        return host.sample(self.host, prompt, n, params, seed)

    def compute_logprobs(self, version: int, prompt: Stream, temperature: float) -> list[float]:
        host.use_version(self.host, version)
        return host.compute_logprobs(self.host, prompt, temperature)

    def play(self, version: int, loop: EpisodeLoop, task: Any, init_states_P: list[Any], n: int,
             params: SamplingParams, seed: int) -> list:
        host.use_version(self.host, version)
        return host.play(self.host, loop, task, init_states_P, n, params, seed)

    def speed_metrics(self) -> dict[str, float]:
        """`speed/*` of this engine's host."""
        return host.speed_metrics(self.host)

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> int:
        """torch's CPU threads in this actor."""
        return torch.get_num_threads()
