"""Several LoRA adapters over one base in one host: a tenant is one user's adapter, with its
gradients, optimiser moments and step count, switched into the model for that user's calls.

    use_tenant(host, Tenant("sess-1:train:0", rank=8, seed=0))   # made fresh on first use
    forward_as(host, datums, tenant, "ppo", LossConfig(), True)   # its forward_backward
    drop_tenant(host, "sess-1:train:0")                           # its memory freed

The session server (`workbench.service`) sends these through a session's executor like any
host function, so the calls of all its users run in one order on the one model. The model
keeps the host's LoRA shape (rank R, alpha A, `SessionSpec.lora`). A tenant of rank r <= R is a
rank-r LoRA zero-padded to R: rows r.. of each A and columns r.. of each B are zero, so their
gradients, Adam moments and decoupled weight decay keep them zero, and the adapter is exactly
a rank-r one with the host's scale A / R. Its A matrices are drawn as peft draws them
(kaiming-uniform, a = sqrt(5), in the model's parameter order, from `seed`), so a tenant of
rank R and the spec's `init_seed` starts from exactly the spec's own adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from workbench.session.host import ModelHost, forward, trainer_weights
from workbench.session.losses import LossConfig
from workbench.session.types import Datum, ForwardBackwardOutput


@dataclass(frozen=True)
class Tenant:
    """Who a call runs as: the adapter's name, and its rank and seed should it be new."""

    name: str
    rank: int = 0  # 0: the host's rank
    seed: int = 0


@dataclass
class Parked:
    """A tenant out of the model: its weights, gradients, optimiser moments and steps."""

    weights: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    moments: dict[str, dict[str, Any]]
    opt_steps: int


def use_tenant(host: ModelHost, tenant: Tenant) -> None:
    """Put `tenant`'s adapter in the model (made fresh on first use), the one there parked."""
    if host.tenant == tenant.name:
        return
    rank = check_rank(host, tenant.rank)
    trainer_weights(host)  # a sampler version in the model goes back to the trainer's weights
    host.tenants[host.tenant] = _park(host)
    incoming = host.tenants.pop(tenant.name, None) or _fresh(host, rank, tenant.seed)
    _restore(host, incoming)
    host.tenant = tenant.name
    host.weights_id += 1  # other weights are in the model: a new id for its versions


def forward_as(host: ModelHost, datums: list[Datum], tenant: Tenant, loss_fn: str,
               cfg: LossConfig, backward: bool) -> ForwardBackwardOutput:
    """`host.forward` as `tenant` (the executors split `datums` over replicas)."""
    use_tenant(host, tenant)
    return forward(host, datums, loss_fn, cfg, backward)


def call_as(host: ModelHost, tenant: Tenant, fn: Any, *args: Any) -> Any:
    """fn(host, *args) as `tenant`: any function of `session.host` or `session.checkpoint`."""
    use_tenant(host, tenant)
    return fn(host, *args)


def drop_tenant(host: ModelHost, name: str) -> bool:
    """Free a parked tenant's tensors -> whether there was one. The tenant in the model is
    parked first (the spec's own adapter takes its place)."""
    if host.tenant == name:
        use_tenant(host, Tenant(""))
    return host.tenants.pop(name, None) is not None


def check_rank(host: ModelHost, rank: int) -> int:
    """The rank a tenant asks for (0: the host's), or a ValueError naming the host's."""
    if host.lora is None:
        raise ValueError("this session trains every weight (lora None): it holds one model, "
                         "not one adapter per user")
    rank = rank or host.lora.rank
    if not 1 <= rank <= host.lora.rank:
        raise ValueError(f"LoRA rank {rank} is not served: this server's adapters have rank "
                         f"1 to {host.lora.rank} (its base's LoRA rank)")
    return rank


def _park(host: ModelHost) -> Parked:
    params = host.trainable()
    return Parked(weights={n: p.detach().clone() for n, p in params.items()},
                  grads={n: p.grad for n, p in params.items()},
                  moments={n: host.optimizer.state.pop(p, {}) for n, p in params.items()},
                  opt_steps=host.opt_steps)


def _restore(host: ModelHost, parked: Parked) -> None:
    with torch.no_grad():
        for name, p in host.trainable().items():
            p.copy_(parked.weights[name])
            p.grad = parked.grads.get(name)
            if parked.moments.get(name):
                host.optimizer.state[p] = parked.moments[name]
    host.opt_steps = parked.opt_steps


def _fresh(host: ModelHost, rank: int, seed: int) -> Parked:
    """A new adapter of `rank` zero-padded to the host's: A drawn as peft draws it, B zero."""
    weights, params = {}, host.trainable()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, p in params.items():
            w = torch.zeros_like(p)
            if ".lora_A." in name:  # peft builds A and B as nn.Linear (each drawn once), then
                out = params[name.replace(".lora_A.", ".lora_B.")].shape[0]
                for shape in ((rank, p.shape[1]), (out, rank), (rank, p.shape[1])):
                    drawn = torch.empty(shape, dtype=p.dtype)  # draws A again
                    torch.nn.init.kaiming_uniform_(drawn, a=math.sqrt(5))
                w[:rank] = drawn.to(p.device)
            weights[name] = w
    return Parked(weights=weights, grads={}, moments={}, opt_steps=0)
