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
from workbench.policy.engine import uses_cuda_graphs
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


def remote_call(actor: Any, method: str, *args: Any) -> Any:
    """actor.method(*args) on a Ray actor handle, waited for (from inside another actor)."""
    import ray

    return ray.get(getattr(actor, method).remote(*args))


def sampler_need(spec: SessionSpec, config: Any) -> dict[str, int]:
    """GPU bytes our engine (engine.name=transformers) takes in a Ray actor, from the model's
    config and the spec: its copy of the weights, the fused decode copy of the text matrices
    (engine.fused_decode), the KV pool of engine.kv_rows x engine.kv_tokens, and a workspace of
    two float32 logit rows per KV row plus a tenth of the rest."""
    from workbench.model.presets import param_counts

    text, size = config.text_config, torch.empty((), dtype=spec.torch_dtype).element_size()
    counts = param_counts(config)
    weights = counts["total"] * size
    graphs = uses_cuda_graphs(spec.engine, spec.device)
    fused = counts["text_linear"] * size if graphs and spec.engine.fused_decode else 0
    rows = spec.engine.kv_rows or 64
    kv = rows * spec.engine.kv_tokens * text.num_hidden_layers * 2 * text.num_key_value_heads \
        * text.head_dim * size
    work = 2 * rows * text.vocab_size * 4 + (weights + fused + kv) // 10
    return {"weights": weights, "fused": fused, "kv_pool": kv, "workspace": work,
            "total": weights + fused + kv + work}


def check_sampler_memory(spec: SessionSpec, config: Any, free_bytes: int) -> int:
    """Our engine's GPU need (`sampler_need`) against the memory free on its GPU when the actor
    starts: its bytes, or a one-line error with the need, what is free and what to change."""
    need = sampler_need(spec, config)
    if need["total"] <= free_bytes:
        return need["total"]
    gib = {k: v / 2**30 for k, v in need.items()}
    raise RuntimeError(
        f"our engine (engine.name=transformers) needs {gib['total']:.1f} GiB on its GPU "
        f"(weights {gib['weights']:.1f}, fused decode copy {gib['fused']:.1f}, KV pool of "
        f"{spec.engine.kv_rows or 64} rows x {spec.engine.kv_tokens} tokens {gib['kv_pool']:.1f}, "
        f"workspace {gib['workspace']:.1f}) but {free_bytes / 2**30:.1f} GiB is free: lower "
        "engine.kv_rows / engine.kv_tokens, set engine.fused_decode=false, give it a GPU of its "
        "own (cluster.colocate_all=false), or sample with engine.name=vllm")


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
        """(weights version, trainable tensors on CPU) for the sampler engines; the version is
        kept here too (`host.save_version`), for the clients' `compute_logprobs`."""
        version = host.save_version(self.host)
        return version, {k: v.cpu() for k, v in self.host.versions[version].items()}

    def hand_version(self, engine: Any, kind: str) -> tuple[int, int]:
        """Save this replica's weights as a sampler version (`host.save_version`) and hand it
        to `engine`, the sampler actor colocated on this replica's GPU, without the object
        store and without a copy of the base in the engine -> (version, bytes handed over).
        kind (`handoff_kind`): "merged" - the LoRA merged into this replica's base weights a
        chunk at a time, each chunk sent as CUDA IPC handles (`vllm.merged.share`) and loaded
        by the engine's vLLM in place; "adapter" - the version's PEFT folder written where
        the engine's vLLM reads it (same node); "factors" - the LoRA tensors as CUDA IPC
        handles, copied into the engine's own model (our engine). On a CPU the tensors travel
        by value."""
        from workbench.vllm.merged import merged_weights, share

        version = host.save_version(self.host)
        tensors = self.host.versions[version]
        factors = sum(t.numel() * t.element_size() for t in tensors.values())
        if kind == "adapter":
            self.host.lm.model.save_pretrained(remote_call(engine, "adapter_folder", version))
            remote_call(engine, "take_version", version)
            return version, factors
        if kind == "factors":
            remote_call(engine, "take_factors", version, share(list(tensors.items())))
            return version, factors
        sent = 0
        for chunk in merged_weights(self.host.lm.model, tensors):
            remote_call(engine, "load_merged", share(chunk), [name for name, _ in chunk])
            sent += sum(t.numel() * t.element_size() for _, t in chunk)
            del chunk  # the engine copied it: one chunk in memory at a time
        remote_call(engine, "end_merged", version)
        return version, sent

    def open_weight_store(self, world_size: int, address: str = "") -> tuple[str, int]:
        """Rank 0: the weight-broadcast group's TCPStore (rank 0 + the engines)."""
        self.weight_store = tcp_store(address, world_size)
        return self.weight_store.host, self.weight_store.port

    def join_weight_group(self, world_size: int) -> None:
        """Rank 0 joins the weight-broadcast group as its rank 0 (after open_weight_store)."""
        cuda = self.host.lm.model.device.type == "cuda"
        self.weight_group = weight_sync.open_group("", 0, 0, world_size, cuda, self.weight_store)

    def send_weights(self) -> int:
        """Broadcast the trainable tensors (one flat buffer) to the engines -> its bytes; the
        version is kept here too (`host.save_version`), for `compute_logprobs`."""
        host.save_version(self.host)
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
    """A sampler: base model (+ LoRA) and the weight versions the trainer sent it; a vLLM
    engine handed its versions by a colocated trainer (`weights=False`) holds the model's
    structure only, vLLM's own copy being the one copy of the weights here."""

    def __init__(self, spec: SessionSpec, weights: bool = True) -> None:
        set_threads(spec.cluster.threads_per_actor)
        if spec.engine.name == "vllm":  # vLLM's engine core in this actor, not a spawned child
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        elif spec.device.startswith("cuda"):  # our engine: sized from the model, checked now
            from workbench.model.load import load_model

            config = load_model(spec.model, spec.torch_dtype, "meta").model.config
            check_sampler_memory(spec, config, torch.cuda.mem_get_info()[0])
        self.host: ModelHost = host.make_host(spec, trainer=False, weights=weights)
        self.weight_group: Any = None

    def adapter_folder(self, version: int) -> str:
        """Where this engine's vLLM reads version `version`'s PEFT adapter from."""
        folder = self.host.engine.adapter_folder(version)  # type: ignore[attr-defined]
        return str(folder.resolve())  # the trainer may run in another working directory

    def take_version(self, version: int) -> int:
        """Version `version` is in place (its adapter folder written by the colocated
        trainer): sample it from now on."""
        host.hold_version(self.host, version)
        return version

    def take_factors(self, version: int, payload: bytes) -> int:
        """Version `version`'s trainable tensors, `share`d by the colocated trainer: copied
        into this engine's model and kept as the version's snapshot."""
        from workbench.vllm.merged import open_shared

        device = next(iter(self.host.trainable().values())).device
        tensors = {name: t.clone() for name, t in open_shared(payload, device)}
        host.install_version(self.host, version, tensors)
        return version

    def load_merged(self, payload: bytes, names: list[str]) -> int:
        """A chunk of a merged version from the colocated trainer (`VLLMEngine.load_merged`)."""
        return self.host.engine.load_merged(payload, names)  # type: ignore[attr-defined]

    def end_merged(self, version: int) -> int:
        """The merged version complete: sample it from now on."""
        loaded = self.host.engine.end_merged(version)  # type: ignore[attr-defined]
        host.hold_version(self.host, version)
        return loaded

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
