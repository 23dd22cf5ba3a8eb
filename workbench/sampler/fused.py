"""A one-token decode step over the sampler's own merged, fused copy of the text weights.

Run through transformers and peft, a decode step of the 8B shape is ~3,600 small kernels: seven
projections a layer, each with peft's LoRA path beside it (a cast to fp32, A, B, scale, add, a
cast back), unfused RMSNorms and rotary. Replayed as a CUDA graph it still takes ~19 ms at batch
64, 23% of the bandwidth bound (benchmarks/RESULTS.md, "The sampler"). What a serving engine
does instead, and what this module does:

- **merged LoRA**: each projection's adapter is folded into a sampler-side copy of its weight
  (W + scale B A, rounded once to the model dtype) whenever the sampler's weights version changes
  (`refresh`, in place: captured graphs keep their addresses). The trainer's weights and adapter
  are untouched; the copy costs the text matrices once more (13.9 GB for the 8B shape);
- **fused projections**: q, k and v are one matrix, gate and up another: 4 GEMMs a layer, not 7;
- **one small function a layer** (`layer_step`) that `torch.compile` can fuse (norms, rotary, the
  KV write, SiLU x up, residual adds) before the step is captured as a CUDA graph
  (`engine.compile_decode`; without it the same function runs eagerly inside the graph).

The step reads and writes the same KV pool (`PoolLayer`) as the transformers path and uses the
model's own embedding, rotary module, final norm and lm_head, so prefill (still transformers,
once a turn) and decode share one cache. Only decode of text tokens goes through here: vision
and deepstack only act on image tokens, which are prefilled.

    fused = fuse_weights(model)            # copies; refresh(fused, model) after a weight change
    logits_R1V = fused_step(fused, layer_step, pool_layers, ids_R1, pos_3R1, index_1, mask_R11W)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from workbench.model.lora import merged_weight
from workbench.policy.forward import base_model


@dataclass
class FusedLayer:
    """One decoder layer's weights as the decode step reads them (LoRA merged)."""

    norm_in_H: torch.Tensor
    qkv_QH: torch.Tensor  # q_proj, k_proj, v_proj stacked: (Hq + 2 Hkv) * D rows
    q_norm_D: torch.Tensor
    k_norm_D: torch.Tensor
    o_HQ: torch.Tensor
    norm_post_H: torch.Tensor
    gate_up_2IH: torch.Tensor  # gate_proj, up_proj stacked
    down_HI: torch.Tensor


@dataclass
class FusedWeights:
    """The text decoder for one-token steps: fused layers plus the model's shared parts."""

    layers: list[FusedLayer]
    text: Any  # the model's text decoder (embed_tokens, rotary_emb, norm): read, not copied
    lm_head: Any  # the model's lm_head module
    heads: int
    kv_heads: int
    eps: float
    version: int | None = None  # the sampler weights version these were merged from


def _layer_tensors(layer: Any) -> dict[str, torch.Tensor]:
    att, mlp = layer.self_attn, layer.mlp
    return {
        "norm_in_H": layer.input_layernorm.weight.detach(),
        "qkv_QH": torch.cat([merged_weight(att.q_proj), merged_weight(att.k_proj),
                             merged_weight(att.v_proj)]),
        "q_norm_D": att.q_norm.weight.detach(),
        "k_norm_D": att.k_norm.weight.detach(),
        "o_HQ": merged_weight(att.o_proj),
        "norm_post_H": layer.post_attention_layernorm.weight.detach(),
        "gate_up_2IH": torch.cat([merged_weight(mlp.gate_proj), merged_weight(mlp.up_proj)]),
        "down_HI": merged_weight(mlp.down_proj),
    }


def fuse_weights(model: Any, version: int | None = None) -> FusedWeights:
    """The sampler's fused copy of `model`'s text decoder (a Qwen3-VL, peft-wrapped or not)."""
    base = base_model(model)
    text = base.model.language_model
    cfg = base.config.text_config
    with torch.no_grad():
        layers = [FusedLayer(**_layer_tensors(layer)) for layer in text.layers]
    return FusedWeights(layers=layers, text=text, lm_head=base.lm_head,
                        heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                        eps=cfg.rms_norm_eps, version=version)


def refresh(fused: FusedWeights, model: Any, version: int | None) -> None:
    """Re-merge `model`'s current weights into `fused` in place (addresses kept for graphs)."""
    text = base_model(model).model.language_model
    with torch.no_grad():
        for dst, layer in zip(fused.layers, text.layers):
            for name, tensor in _layer_tensors(layer).items():
                target = getattr(dst, name)
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor)
    fused.version = version


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm: normalise in float32, scale in the input dtype (transformers' order)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def layer_step(w: FusedLayer, h_R1H: torch.Tensor, cos_R11D: torch.Tensor,
               sin_R11D: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               index_1: torch.Tensor, mask_R11W: torch.Tensor, heads: int, kv_heads: int,
               eps: float) -> torch.Tensor:
    """One decoder layer for one token a row: writes the row's K, V at column index_1 of the pool
    ([rows, Hkv, C, D]), attends over the first W columns (mask_R11W), returns the new hidden."""
    R, D, W = h_R1H.shape[0], k_pool.shape[-1], mask_R11W.shape[-1]
    qkv = F.linear(rms_norm(h_R1H, w.norm_in_H, eps), w.qkv_QH)
    q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q_RH1D = rms_norm(q.view(R, 1, heads, D), w.q_norm_D, eps).transpose(1, 2)
    k_RH1D = rms_norm(k.view(R, 1, kv_heads, D), w.k_norm_D, eps).transpose(1, 2)
    v_RH1D = v.view(R, 1, kv_heads, D).transpose(1, 2)
    q_RH1D, k_RH1D = _rotate(q_RH1D, cos_R11D, sin_R11D), _rotate(k_RH1D, cos_R11D, sin_R11D)
    k_pool[:R].index_copy_(2, index_1, k_RH1D)
    v_pool[:R].index_copy_(2, index_1, v_RH1D)
    # grouped-query: query head h reads KV head h // G; the group rides on the query-length axis
    q_RKGD = q_RH1D.reshape(R, kv_heads, heads // kv_heads, D)
    att_RKGD = F.scaled_dot_product_attention(q_RKGD, k_pool[:R, :, :W], v_pool[:R, :, :W],
                                              attn_mask=mask_R11W, scale=D ** -0.5)
    h_R1H = h_R1H + F.linear(att_RKGD.reshape(R, 1, heads * D), w.o_HQ)
    gate, up = F.linear(rms_norm(h_R1H, w.norm_post_H, eps), w.gate_up_2IH).chunk(2, dim=-1)
    return h_R1H + F.linear(F.silu(gate) * up, w.down_HI)


LayerStep = Callable[..., torch.Tensor]


def compiled_layer_step() -> LayerStep:
    """`layer_step` through torch.compile (inductor: fused norms, rotary and epilogues; the rows
    and the attention window are symbolic, so one compilation serves every graph)."""
    return torch.compile(layer_step, dynamic=True)


def fused_step(fused: FusedWeights, step: LayerStep, pool_layers: list[Any],
               ids_R1: torch.Tensor, pos_3R1: torch.Tensor, index_1: torch.Tensor,
               mask_R11W: torch.Tensor) -> torch.Tensor:
    """One decode step of R rows: logits (R, 1, V). `step` is `layer_step` or its compiled form;
    `pool_layers` are the cache's PoolLayers (their buffers `_k`, `_v`)."""
    text = fused.text
    h_R1H = text.embed_tokens(ids_R1)
    cos_R1D, sin_R1D = text.rotary_emb(h_R1H, pos_3R1)
    cos_R11D, sin_R11D = cos_R1D[:, None], sin_R1D[:, None]
    for w, pool in zip(fused.layers, pool_layers):
        h_R1H = step(w, h_R1H, cos_R11D, sin_R11D, pool._k, pool._v, index_1, mask_R11W,
                     fused.heads, fused.kv_heads, fused.eps)
    return fused.lm_head(text.norm(h_R1H))
