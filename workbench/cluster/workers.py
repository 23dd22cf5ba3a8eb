"""The two Ray actor kinds, as plain classes (`ray.remote` wraps them when a session starts).

Both build their `ModelHost` from the session's `SessionSpec` (`session.host.make_host`), so an
actor honours exactly what an in-process session honours (dtype, device, engine, speed).

Both run the host functions the clients send them (`call`: `host.forward`, `host.optim_step`,
`host.play`, the checkpoint functions, ...) on their host.

TrainerWorker: one data-parallel replica of the policy and its optimiser. With N > 1 workers
they form a torch.distributed group (gloo on CPU, NCCL on CUDA) whose rendezvous is a TCPStore
that rank 0 opens on a free port of its node, and the host sums its gradients over the group
before it uses them (`ModelHost.sum_grads`).

SamplerEngine: its own copy of the base model (+ LoRA), the sampler weight versions it has been
sent, the sampler engine that draws the tokens (engine.name: transformers, or vLLM loading
each version's adapter), and the episode loop it is handed (`host.play`) beside it. A vLLM
engine runs its engine core inside the actor (VLLM_ENABLE_V1_MULTIPROCESSING=0: no process
spawned from a Ray worker) on the GPU share Ray gave the actor, within
engine.gpu_memory_utilization of that GPU.

Both can also join a weight-broadcast group (`cluster.weight_sync`): trainer rank 0 sends its
trainable tensors as one buffer, the engines receive and install them as a sampler version.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from workbench.cluster import weight_sync
from workbench.cluster.metrics import GaugeSet
from workbench.cluster.parallel import all_reduce_grads, shard_frozen_base
from workbench.cluster.weight_sync import GROUP_TIMEOUT
from workbench.session import host
from workbench.session.host import ModelHost
from workbench.session.spec import SessionSpec


def set_threads(threads: int) -> None:
    """torch's CPU threads in this actor (0: keep Ray's OMP_NUM_THREADS, its CPU share >= 1)."""
    if threads > 0:
        torch.set_num_threads(threads)


def tcp_store(address: str, world_size: int) -> Any:
    """A master TCPStore on a free port of this node (Ray's address for it unless given)."""
    from torch.distributed import TCPStore

    if not address:
        import ray

        address = ray.util.get_node_ip_address()
    return TCPStore(address, 0, world_size, is_master=True, wait_for_workers=False,
                    timeout=GROUP_TIMEOUT)


def device_memory() -> dict[str, Any]:
    """This process's GPU: its uuid, torch's allocated / reserved / peak bytes, and the bytes in
    use on the whole device by every process (empty on a machine without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"gpu": str(torch.cuda.get_device_properties(0).uuid),
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "peak": torch.cuda.max_memory_allocated(), "device_used": total - free,
            "device_total": total}


class TrainerWorker:
    """Rank `rank` of `world_size` data-parallel trainers."""

    def __init__(self, spec: SessionSpec, rank: int) -> None:
        set_threads(spec.cluster.threads_per_actor)
        self.host = host.make_host(spec, sampler=False)
        self.rank, self.world_size = rank, spec.cluster.num_workers
        self.strategy = spec.cluster.strategy
        self.store: Any = None
        self.weight_store: Any = None
        self.weight_group: Any = None
        self.gauges = GaugeSet()

    def open_store(self, address: str = "") -> tuple[str, int]:
        """Rank 0: a TCPStore on a free port of this node (Ray's address for it unless given)
        -> (address, port) for the others."""
        self.store = tcp_store(address, self.world_size)
        return self.store.host, self.store.port

    def join(self, address: str, port: int) -> None:
        """Join the process group (all ranks at once); fsdp then shards the frozen base."""
        import torch.distributed as dist
        from torch.distributed import TCPStore

        store = self.store or TCPStore(address, port, self.world_size, is_master=False,
                                       timeout=GROUP_TIMEOUT)
        backend = "nccl" if self.host.lm.model.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank,
                                world_size=self.world_size, timeout=GROUP_TIMEOUT)
        if self.world_size > 1:  # the same step everywhere: every slice's gradients summed
            self.host.sum_grads = all_reduce_grads
        if self.strategy == "fsdp":
            shard_frozen_base(self.host.lm.model, list(self.host.trainable().values()))

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(weights version, trainable tensors on CPU) for the sampler engines."""
        host.trainer_weights(self.host)
        return self.host.weights_id, {k: v.cpu() for k, v in host.snapshot(self.host).items()}

    def open_weight_store(self, world_size: int, address: str = "") -> tuple[str, int]:
        """Rank 0: the weight-broadcast group's TCPStore (rank 0 + the engines)."""
        self.weight_store = tcp_store(address, world_size)
        return self.weight_store.host, self.weight_store.port

    def join_weight_group(self, world_size: int) -> None:
        """Rank 0 joins the weight-broadcast group as its rank 0 (after open_weight_store)."""
        cuda = self.host.lm.model.device.type == "cuda"
        self.weight_group = weight_sync.open_group("", 0, 0, world_size, cuda, self.weight_store)

    def send_weights(self) -> int:
        """Broadcast the trainable tensors (one flat buffer) to the engines -> its bytes."""
        host.trainer_weights(self.host)
        flat = weight_sync.flatten(dict(self.host.trainable()))
        weight_sync.broadcast(self.weight_group, flat)
        return flat.numel() * flat.element_size()

    def weights_version(self) -> int:
        """The version the trainable weights are at (bumps with every optim_step)."""
        return self.host.weights_id

    def memory(self) -> dict[str, Any]:
        """This actor's GPU memory (see device_memory)."""
        return device_memory()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(host, *args): forward, optim_step, the checkpoint functions, describe_host, ..."""
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
        if spec.engine.name == "vllm":  # vLLM's engine core in this actor, not a spawned child
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.host: ModelHost = host.make_host(spec, trainer=False)
        self.weight_group: Any = None

    def install(self, snapshot: tuple[int, dict[str, torch.Tensor]]) -> int:
        """Load a trainer snapshot as sampler version `snapshot[0]`; returns it."""
        version, tensors = snapshot
        host.install_version(self.host, version, tensors)
        return version

    def join_weight_group(self, address: str, port: int, rank: int, world_size: int) -> None:
        """Join trainer rank 0's weight-broadcast group as rank `rank` (1..M)."""
        cuda = self.host.lm.model.device.type == "cuda"
        self.weight_group = weight_sync.open_group(address, port, rank, world_size, cuda)

    def receive_weights(self, version: int) -> int:
        """Receive rank 0's broadcast and install it as sampler version `version`."""
        like = dict(self.host.trainable())
        first = next(iter(like.values()))
        flat = torch.empty(sum(t.numel() for t in like.values()), dtype=first.dtype,
                           device=first.device)
        weight_sync.broadcast(self.weight_group, flat)
        host.install_version(self.host, version, weight_sync.unflatten(flat, like))
        return version

    def memory(self) -> dict[str, Any]:
        """This actor's GPU memory (see device_memory), with a vLLM engine's own budget."""
        return device_memory() | vllm_memory(self.host.engine)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(host, *args): sample, play, compute_logprobs, speed_metrics, inspection, ..."""
        return fn(self.host, *args)

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> int:
        """torch's CPU threads in this actor."""
        return torch.get_num_threads()


def vllm_memory(engine: Any) -> dict[str, Any]:
    """A vLLM engine's memory budget (gpu_memory_utilization x the device) and KV-cache blocks,
    where this vLLM version exposes them; {} for other engines."""
    if getattr(engine, "name", "") != "vllm":
        return {}
    config = getattr(getattr(engine.llm, "llm_engine", None), "vllm_config", None)
    cache = getattr(config, "cache_config", None)
    if cache is None:
        return {"vllm": True}
    total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0
    return {"vllm_utilization": cache.gpu_memory_utilization,
            "vllm_budget": int(cache.gpu_memory_utilization * total),
            "vllm_kv_blocks": cache.num_gpu_blocks, "vllm_block_size": cache.block_size}
