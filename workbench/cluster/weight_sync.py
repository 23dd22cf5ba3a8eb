"""Weight syncs from trainer rank 0 to the sampler engines without Ray's object store.

The default sync (`save_weights_and_get_sampling_client`) copies rank 0's trainable tensors to
the CPU, through Ray's object store, and back onto each engine's device. After
`RaySession.open_weight_broadcast()` the same sync is one broadcast of one flat buffer over a
second process group of trainer rank 0 (rank 0) and the M engines (ranks 1..M): NCCL on GPUs
(device to device, over NVLink between GPUs), gloo on CPUs. That group is built beside the
trainers' data-parallel group (a torch.distributed process can have one default group only), from
its own TCPStore that trainer rank 0 opens.

NCCL refuses two ranks on one GPU, so the broadcast needs rank 0 and every engine on GPUs of
their own (cluster.colocate_all=false); `check_distinct_gpus` says so in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

GROUP_TIMEOUT = timedelta(minutes=10)  # a collective (or store) waiting longer fails
STORE_PREFIX = "weights/"


def flatten(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D buffer of the tensors, in their dict order (one dtype)."""
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"a weight broadcast sends one dtype; the trainable tensors have "
                         f"{sorted(str(d) for d in dtypes)}")
    return torch.cat([t.detach().reshape(-1) for t in tensors.values()])


def unflatten(flat: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of `flat` shaped as `like`'s tensors, by name (inverse of flatten)."""
    total = sum(t.numel() for t in like.values())
    if total != flat.numel():
        raise ValueError(f"broadcast buffer holds {flat.numel()} values, the model's trainable "
                         f"tensors {total}: trainer and engine were built from different specs")
    out, offset = {}, 0
    for name, t in like.items():
        out[name] = flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
    return out


def open_group(address: str, port: int, rank: int, world_size: int, cuda: bool,
               store: Any = None) -> Any:
    """A process group of its own (not the default one): NCCL on CUDA, gloo on the CPU."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    base = store or TCPStore(address, port, world_size, is_master=False, timeout=GROUP_TIMEOUT)
    prefixed = PrefixStore(STORE_PREFIX, base)
    if cuda:
        from torch.distributed import ProcessGroupNCCL

        return ProcessGroupNCCL(prefixed, rank, world_size, ProcessGroupNCCL.Options())
    return ProcessGroupGloo(prefixed, rank, world_size, GROUP_TIMEOUT)


def broadcast(group: Any, flat: torch.Tensor) -> None:
    """Rank 0's `flat` into every rank's `flat` (same size and dtype everywhere)."""
    group.broadcast(flat, 0).wait()
    if flat.device.type == "cuda":
        torch.cuda.synchronize(flat.device)


def check_distinct_gpus(trainer_gpu: str, engine_gpus: list[str]) -> None:
    """ValueError in one line when an engine shares trainer rank 0's GPU (NCCL refuses it)."""
    shared = [k for k, gpu in enumerate(engine_gpus) if gpu and gpu == trainer_gpu]
    if shared:
        raise ValueError(f"a weight broadcast over NCCL needs trainer rank 0 and each engine on "
                         f"GPUs of their own, but engine {shared[0]} shares rank 0's GPU "
                         "(cluster.colocate_all=true): keep the object-store sync there, or "
                         "set cluster.colocate_all=false")
