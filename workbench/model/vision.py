"""One attention call per vision layer for a batch of same-size images.

Qwen3-VL's vision tower packs every image's patches into one sequence. Without FlashAttention's
variable-length kernel (this project uses SDPA), transformers attends image by image: a Python
loop of one SDPA call per image in each of the tower's layers, after a device-to-host copy of the
image lengths. An update of 4 episodes of the 8B shape encodes 60 images: 27 layers x 60 = 1,620
tiny attention calls whose launches keep the GPU waiting (benchmarks/RESULTS.md, "The update").

A maze's images all have one size, so the packed sequence is N images x L patches: the same
attention is one SDPA call over a batch of N. `batch_vision_attention(model)` gives each vision
attention module that forward; a batch of mixed sizes, or another attention implementation, goes
through transformers' own forward unchanged. Every host installs it (`session.host.make_host`):
on the CPU too, where a tiny 9x9 update's 100 images x 8 vision layers were 800 calls. It agrees
with transformers' loop to about 1e-6, not bit for bit.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import torch
import torch.nn.functional as F


def linear_patch_embed(model: torch.nn.Module) -> int:
    """Give every Qwen3-VL vision patch embedding a linear forward: its Conv3d's kernel is its
    stride and its input exactly one kernel, so the convolution is one matrix product over the
    flattened patch (the same weights; on the CPU 3x faster than oneDNN's Conv3d with its
    gradient). Returns how many modules there are."""
    count = 0
    for module in model.modules():
        if type(module).__name__ == "Qwen3VLVisionPatchEmbed":
            module.forward = _linear_embed_forward.__get__(module)
            count += 1
    return count


def _linear_embed_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.proj.weight
    flat = hidden_states.to(weight.dtype).reshape(-1, weight[0].numel())
    return F.linear(flat, weight.reshape(weight.shape[0], -1), self.proj.bias)


def batch_vision_attention(model: torch.nn.Module, on: bool = True) -> int:
    """Install `batched_forward` on every Qwen3-VL vision attention module of `model` (once), or
    (on=False) give them transformers' forward back; returns how many modules there are."""
    count = 0
    for module in model.modules():
        if type(module).__name__ != "Qwen3VLVisionAttention":
            continue
        module = cast(Any, module)  # attributes set on an nn.Module instance
        if not hasattr(module, "hf_forward"):
            module.hf_forward = module.forward

            def forward(*args: Any, _module: Any = module, **kwargs: Any) -> torch.Tensor:
                return batched_forward(_module, _module.hf_forward, *args, **kwargs)

            module.batched_forward = forward
        module.forward = module.batched_forward if on else module.hf_forward
        module.batched_images = on
        count += 1
    return count


def batched_forward(module: Any, hf_forward: Any, hidden_states: torch.Tensor,
                    cu_seqlens: torch.Tensor,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                    **kwargs: Any) -> torch.Tensor:
    """The vision attention over N same-size images as one SDPA call on (N, heads, L, dim);
    transformers' forward (`hf_forward`) for mixed sizes or a non-SDPA implementation."""
    lengths = torch.diff(cu_seqlens).tolist()  # one host copy a layer, as transformers' loop
    if module.config._attn_implementation != "sdpa" or len(set(lengths)) != 1:
        return hf_forward(hidden_states, cu_seqlens=cu_seqlens,
                          position_embeddings=position_embeddings, **kwargs)
    rotary = sys.modules[type(module).__module__].apply_rotary_pos_emb_vision
    S, N, L, H = hidden_states.shape[0], len(lengths), lengths[0], module.num_heads
    q_SHD, k_SHD, v_SHD = module.qkv(hidden_states).reshape(S, 3, H, -1).permute(1, 0, 2, 3) \
        .unbind(0)
    assert position_embeddings is not None, "Qwen3-VL's vision blocks pass rotary embeddings"
    q_SHD, k_SHD = rotary(q_SHD, k_SHD, *position_embeddings)
    q_NHLD, k_NHLD, v_NHLD = (t.reshape(N, L, H, -1).transpose(1, 2)
                              for t in (q_SHD, k_SHD, v_SHD))
    out_NHLD = F.scaled_dot_product_attention(q_NHLD, k_NHLD, v_NHLD, scale=module.scaling)
    return module.proj(out_NHLD.transpose(1, 2).reshape(S, -1))
