"""SDPA attention that reads a grouped-query KV cache once per decoded token.

transformers' `sdpa` attention repeats each KV head for its query group (`repeat_kv`) whenever an
attention mask is given, which the batched sampler always gives (its cache has holes). For a
one-token decode step that copies the whole cache (32 query heads over 8 KV heads: 4 copies) and
reads it 4 times: decode then moves several times the bytes of the cache, and each turn's prefill
copies the whole cache of every layer. Here the query group is folded into the query-length axis
instead, q (B, Hq, Q, D) -> (B, Hkv, G * Q, D) with the mask rows repeated per group member, so
SDPA reads each KV head once; the result is the same attention. Calls without a mask (training:
causal, GQA inside the fused kernel) and without groups (the vision tower) go to transformers' own
`sdpa_attention_forward` unchanged.

    use_gqa_decode_attention(model)   # registers "sdpa_gqa_decode" and switches the model to it
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.policy.forward import base_model

NAME = "sdpa_gqa_decode"


def gqa_decode_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: folded GQA for one-token steps, else sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or attention_mask is None or attention_mask.shape[1] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, Hq, Q, D = query.shape
    W = key.shape[-2]
    # query head h uses KV head h // groups: (B, Hkv, G * Q, D), row g * Q + i is query i
    q_BHRD = query.reshape(B, Hq // groups, groups * Q, D)
    mask = attention_mask[:, :, :, :W]  # (B, 1, Q, W)
    if Q > 1:  # every group member sees query i's mask row
        mask = mask.expand(B, groups, Q, W).reshape(B, 1, groups * Q, W)
    out_BHRD = torch.nn.functional.scaled_dot_product_attention(
        q_BHRD, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out_BHRD.reshape(B, Hq, Q, D).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the function (and sdpa's mask builder) under NAME with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, gqa_decode_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME


def use_gqa_decode_attention(model: Any) -> None:
    """Switch a (possibly peft-wrapped) Qwen3-VL's text attention to NAME; vision stays sdpa."""
    base = base_model(model)
    base.set_attn_implementation({"text_config": register(), "vision_config": "sdpa"})
