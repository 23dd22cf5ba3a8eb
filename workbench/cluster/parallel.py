"""Data parallelism over trainer workers: split the datums, sum the gradients, merge results.

`phases.update` folds the batch's mean reduction into the datum weights and asks for the loss
"sum", so the batch gradient is a sum over datums. Each of N workers runs forward/backward on a
contiguous slice of the datums; before the optimiser step the workers all-reduce (SUM) their
gradients, so every worker steps with the full-batch gradient and the replicas stay identical.
What the workers return is merged as one worker would have returned it: losses summed, metrics
weighted by tokens, log-probs in the original datum order.

strategy "fsdp" (GPU) additionally shards the frozen base weights over the workers with FSDP2
(`fully_shard`); the trainable (LoRA) weights are left out of FSDP (`ignored_params`), stay
whole on every worker and are all-reduced like ddp, so checkpoints and sampler snapshots are
the same code for both strategies.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import torch

from workbench.session.types import Datum, ForwardBackwardOutput, empty_output

LAYER_NAME = re.compile(r"\.(layers|blocks)\.\d+$")  # decoder layers, vision blocks
WEIGHTED = ("kl_sampler_trainer", "clip_fraction", "entropy")  # token means over the batch


def split_B(items: list, parts: int) -> list[list]:
    """Contiguous slices whose sizes differ by at most one (the first ones get the extra)."""
    size, extra = divmod(len(items), parts)
    bounds = [k * size + min(k, extra) for k in range(parts + 1)]
    return [items[bounds[k]:bounds[k + 1]] for k in range(parts)]


def padded_shards(datums: list[Datum], parts: int) -> tuple[list[list[Datum]], list[int]]:
    """Shards for collective strategies (fsdp): an empty shard gets one zero-weight copy of the
    first datum, so every worker runs the same number of forwards. Returns shards, real sizes."""
    shards = split_B(datums, parts)
    sizes = [len(s) for s in shards]
    if datums:
        blank = replace(datums[0], weights_T=tuple(0.0 for _ in datums[0].weights_T))
        shards = [s or [blank] for s in shards]
    return shards, sizes


def merge_outputs(outs: list[ForwardBackwardOutput], sizes: list[int]) -> ForwardBackwardOutput:
    """One output from the workers' outputs (sizes: real datums of each worker's shard)."""
    real = [(o, n) for o, n in zip(outs, sizes) if n > 0]
    if len(real) == 1:
        return real[0][0]
    if not real:
        return empty_output()
    tokens = sum(o.metrics["tokens"] for o, _ in real)
    metrics = {k: sum(o.metrics[k] * o.metrics["tokens"] for o, _ in real) / max(tokens, 1)
               for k in WEIGHTED}
    loss = sum(o.loss for o, _ in real)
    logprobs = [lp for o, n in real for lp in o.logprobs_B_T[:n]]
    return ForwardBackwardOutput(loss, {"loss": loss} | metrics | {"tokens": tokens}, logprobs)


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the process group, in one flat buffer. A gradient
    that no worker produced stays None (AdamW skips it, as it would on one worker)."""
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    has_grad_P = torch.tensor([float(p.grad is not None) for p in params],
                              dtype=grads[0].dtype, device=grads[0].device)
    flat = torch.cat([g.reshape(-1) for g in grads] + [has_grad_P])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
        offset += g.numel()
    for p, seen in zip(params, flat[offset:].tolist()):
        if seen == 0:
            p.grad = None


def shard_frozen_base(model: Any, trainable: list[torch.nn.Parameter]) -> Any:
    """FSDP2: shard the frozen weights of each decoder layer and vision block over the process
    group, each layer gathering its weights in its own forward and backward; trainable
    parameters are ignored by FSDP (whole on every worker). The rest (embeddings, lm_head,
    norms, the vision merger) stays whole: the update calls those modules directly
    (`policy.forward`), not through the model's forward, where a root FSDP unit would gather
    them."""
    from torch.distributed.fsdp import fully_shard

    ignored = set(trainable)
    layers = [m for name, m in model.named_modules() if LAYER_NAME.search(name)]
    for layer in layers:
        fully_shard(layer, ignored_params=ignored)
    return model
