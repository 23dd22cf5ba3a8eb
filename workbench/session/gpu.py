"""The trainer's GPU fast paths (`SpeedSettings` in session/spec.py switches them on when a host
is built, `session.host.make_host`):

- gradient checkpointing (activations of one layer at a time, recomputed in backward), full or
  selective (keep matmul and attention outputs, recompute the elementwise ops);
- torch.compile of each text decoder layer for the update.

The sampler's fast paths (KV pool, CUDA graphs, fused decode weights, GQA decode attention) live
in `workbench.sampler` (graphs, fused, attention).
"""

from __future__ import annotations

from typing import Any


def _keep_matmuls(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing policy: keep the outputs of the base model's matmuls and of
    attention; recompute everything else (norms, rotary, SiLU, casts, LoRA's rank-r products)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    if func in (aten._scaled_dot_product_efficient_attention.default,
                aten._scaled_dot_product_flash_attention.default,
                aten._scaled_dot_product_cudnn_attention.default,
                aten._scaled_dot_product_flash_attention_for_cpu.default):
        return CheckpointPolicy.MUST_SAVE
    if func in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        left = args[1] if func is aten.addmm.default else args[0]
        if left.shape[-1] > 64:  # not LoRA's B (inner dimension = rank): cheap to recompute
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def keep_matmuls_context() -> tuple[Any, Any]:
    """`context_fn` for torch.utils.checkpoint: the `_keep_matmuls` policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_matmuls)


def set_checkpointing(model: Any, on: bool, selective: bool = False) -> None:
    """Gradient checkpointing of each decoder layer: off; full (recompute the layer's forward in
    backward); or selective (keep matmul and attention outputs, recompute the elementwise ops:
    most of full checkpointing's memory saving for a small part of its recompute)."""
    if not on:
        model.gradient_checkpointing_disable()
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = keep_matmuls_context
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_for_training(model: Any) -> None:
    """torch.compile each text decoder layer for the update (grad enabled): inductor fuses the
    elementwise work around the matmuls (fp32 RMSNorms, rotary, SiLU x up, residuals, the LoRA
    epilogue) forward and backward, and its partitioner recomputes cheap ops instead of saving
    them. Calls without grad (the sampler's prefill, `forward`) stay eager. Shapes are dynamic,
    and every layer's input requires grad (the embeddings' output is made to, as for
    checkpointing; the first layer would otherwise see a frozen input and compile apart): one
    compilation serves every layer and sequence length (a multiple of 8: forward.make_batch).
    Idempotent."""
    import torch

    from workbench.policy.forward import TRAIN_LENGTH_MULTIPLE, base_model

    base = base_model(model)
    base.enable_input_require_grads()
    base.train_length_multiple = TRAIN_LENGTH_MULTIPLE  # forward.token_logprobs pads to it
    for layer in base.model.language_model.layers:
        if getattr(layer, "compiled_for_training", False):
            continue
        eager = layer.forward
        compiled = torch.compile(eager, dynamic=True)

        def forward(*args: Any, _eager: Any = eager, _compiled: Any = compiled,
                    **kwargs: Any) -> Any:
            return (_compiled if torch.is_grad_enabled() else _eager)(*args, **kwargs)

        layer.forward = forward
        layer.compiled_for_training = True
