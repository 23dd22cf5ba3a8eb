"""The two Ray actor kinds, as plain classes (`ray.remote` wraps them when a session starts).

TrainerWorker: one data-parallel replica of the policy and its optimiser (a `ModelHost`). It runs
the in-process session's functions (`_forward`, `_optim_step`, the checkpoint functions) on its
host; with N > 1 workers they form a torch.distributed group (gloo on CPU, NCCL on CUDA) whose
rendezvous is a TCPStore that rank 0 opens on a free port of its node.

SamplerEngine: its own copy of the base model (+ LoRA), the sampler weight versions it has been
sent, the sampler engine that draws the tokens (generator.engine: transformers, or vLLM loading
each version's adapter), and the environment loop (`play_model`) beside it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from workbench.cluster.metrics import GaugeSet
from workbench.cluster.parallel import all_reduce_grads, empty_output, shard_frozen_base
from workbench.envs import InitState, MazeConfig
from workbench.model import LoraSettings
from workbench.policy import SamplingParams, Stream
from workbench.policy.engine import EngineSettings
from workbench.session.gpu import SpeedSettings, apply_speed
from workbench.session.inprocess import (
    ModelHost,
    _compute_logprobs,
    _forward,
    _install_version,
    _optim_step,
    _rollout,
    _sample,
    _snapshot,
    _use_version,
    _with_trainer_weights,
    make_host,
)
from workbench.session.losses import LossConfig
from workbench.session.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepOutput

GROUP_TIMEOUT = timedelta(minutes=10)  # a collective waiting longer than this fails


def set_threads(threads: int) -> None:
    """torch's CPU threads in this actor (0: keep Ray's OMP_NUM_THREADS, its CPU share >= 1)."""
    if threads > 0:
        torch.set_num_threads(threads)


class TrainerWorker:
    """Rank `rank` of `world_size` data-parallel trainers."""

    def __init__(self, model: str, lora: LoraSettings | None, workdir: str, dtype: torch.dtype,
                 device: str, rank: int, world_size: int, strategy: str,
                 threads: int = 0, speed: SpeedSettings = SpeedSettings()) -> None:
        set_threads(threads)
        self.host = make_host(model, lora, Path(workdir), dtype, device)
        apply_speed(self.host, speed, sampler=False)
        self.rank, self.world_size, self.strategy = rank, world_size, strategy
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
        return _forward(self.host, datums, loss_fn, cfg, backward)

    def optim_step(self, adam: AdamParams) -> OptimStepOutput:
        """All-reduce (SUM) the gradients over the workers, then the same step everywhere."""
        if self.world_size > 1:
            _with_trainer_weights(self.host)
            all_reduce_grads(list(self.host.trainable().values()))
        return _optim_step(self.host, adam)

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(weights version, trainable tensors on CPU) for the sampler engines."""
        _with_trainer_weights(self.host)
        return self.host.weights_id, {k: v.cpu() for k, v in _snapshot(self.host).items()}

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

    def __init__(self, model: str, lora: LoraSettings | None, workdir: str, dtype: torch.dtype,
                 device: str, gpu_memory_utilization: float, engine: str = "transformers",
                 threads: int = 0, speed: SpeedSettings = SpeedSettings()) -> None:
        set_threads(threads)
        if device.startswith("cuda") and engine == "transformers":  # keep to its GPU share
            torch.cuda.set_per_process_memory_fraction(gpu_memory_utilization)  # (vLLM does)
        self.host: ModelHost = make_host(model, lora, Path(workdir), dtype, device,
                                         hash_weights=False,
                                         engine=EngineSettings(engine, gpu_memory_utilization))
        apply_speed(self.host, speed, trainer=False)

    def install(self, snapshot: tuple[int, dict[str, torch.Tensor]]) -> int:
        """Load a trainer snapshot as sampler version `snapshot[0]`; returns it."""
        version, tensors = snapshot
        _install_version(self.host, version, tensors)
        return version

    def sample(self, version: int, prompt: Stream, n: int, params: SamplingParams,
               seed: int) -> Any:
        _use_version(self.host, version)
        return _sample(self.host, prompt, n, params, seed)

    def compute_logprobs(self, version: int, prompt: Stream, temperature: float) -> list[float]:
        _use_version(self.host, version)
        return _compute_logprobs(self.host, prompt, temperature)

    def rollout(self, version: int, config: MazeConfig, init_states_P: list[InitState], n: int,
                params: SamplingParams, seed: int) -> list:
        _use_version(self.host, version)
        return _rollout(self.host, config, init_states_P, n, params, seed)

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> int:
        """torch's CPU threads in this actor."""
        return torch.get_num_threads()
