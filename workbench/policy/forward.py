"""Batched forward passes over streams, and the one log-probability rule sampler and trainer share.

`token_logprobs` is the single definition of a token's log-probability: logits divided by the
sampling temperature, the banned (vision special) tokens removed, log-softmax. The sampler
reports it for every token it draws; the trainer recomputes it over the same stream. Before any
update the two agree within float tolerance (tests/test_policy.py pins it).

The trainer's batches encode each distinct image once (`make_batch(..., distinct_images=True)`):
the G episodes of a maze see the same squares again and again, and the vision tower's features
of an image do not depend on where it sits. Its output is handed to the model as
`mm_encoder_outputs` (transformers >= 5.20), each image's features repeated where it occurs, so
the gradient of a repeated image is the sum over its uses, as without the sharing.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from workbench.policy.stream import Stream, VisionInput


@dataclass
class Batch:
    """Padded model inputs for B streams of up to L tokens."""

    input_ids_BL: torch.Tensor
    attention_mask_BL: torch.Tensor | None
    mm_types_BL: torch.Tensor
    position_ids_3BL: torch.Tensor  # M-RoPE positions (temporal, height, width)
    pixel_values: torch.Tensor | None  # all images, stream order then image order (or distinct)
    grid_thw_N3: torch.Tensor | None
    lengths_B: list[int]
    left_padded: bool
    image_index_N: list[int] | None = None
    # distinct images: pixel_values/grid hold each once, occurrence n is image image_index_N[n]


def base_model(model: Any) -> Any:
    """The transformers model inside a peft wrapper (the model itself when not wrapped)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def core_model(model: Any) -> Any:
    """The Qwen3VLModel inside a (possibly peft-wrapped) conditional-generation model."""
    return base_model(model).model


TRAIN_LENGTH_MULTIPLE = 8
"""With compiled decoder layers (session/gpu.py sets `train_length_multiple` on the model),
training batches are right-padded to a multiple of 8 tokens: the compiled layers specialise on
whether the length is a multiple of 8, and would otherwise compile twice (about 30 s each at 8B)
as step lengths come and go. Eager models keep their exact lengths (and GEMM shapes)."""


def make_batch(model: Any, streams: list[Stream], pad_id: int, left: bool,
               distinct_images: bool = False, multiple: int = 1) -> Batch:
    """Pad streams to one batch (left padding for sampling, right for training) of a length that
    is a multiple of `multiple`; with `distinct_images`, equal images (same pixels) are encoded
    once (see the module docstring)."""
    ids, mask, types, lengths = token_tables(streams, pad_id, left, multiple)
    images = [img for s in streams for img in s.images]
    grid = torch.stack([i.grid_thw for i in images]) if images else None
    positions, _ = core_model(model).get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=mask
    )
    index = None
    # (a class is hashable; mypy's Hashable check rejects type[...] for functools.cache)
    if images and distinct_images and takes_encoder_outputs(type(core_model(model))):  # type: ignore[arg-type]
        images, index = distinct(images)
    pixels = torch.cat([i.pixel_values for i in images]) if images else None
    device = model.device
    return Batch(
        input_ids_BL=ids.to(device),
        attention_mask_BL=mask.to(device),
        mm_types_BL=types.to(device),
        position_ids_3BL=positions.to(device),
        pixel_values=pixels.to(device, model.dtype) if pixels is not None else None,
        grid_thw_N3=torch.stack([i.grid_thw for i in images]).to(device) if images else None,
        lengths_B=lengths,
        left_padded=left,
        image_index_N=index,
    )


def token_tables(streams: list[Stream], pad_id: int, left: bool, multiple: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Token ids, attention mask and modality types (B, L) of padded streams, and their
    lengths."""
    lengths = [len(s) for s in streams]
    L = -(-max(lengths) // multiple) * multiple
    ids = torch.full((len(streams), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(streams), L), dtype=torch.long)
    types = torch.zeros((len(streams), L), dtype=torch.long)
    for b, s in enumerate(streams):
        sl = slice(L - len(s), L) if left else slice(0, len(s))
        ids[b, sl] = torch.tensor(s.tokens_T)
        mask[b, sl] = 1
        types[b, sl] = torch.tensor(s.mm_types_T)
    return ids, mask, types, lengths


def image_digest(image: VisionInput) -> bytes:
    """What makes two images the same for the trainer: their pixels and grid."""
    digest = hashlib.sha1(image.pixel_values.contiguous().numpy().tobytes())
    digest.update(image.grid_thw.numpy().tobytes())
    return digest.digest()


def distinct(images: list[VisionInput]) -> tuple[list[VisionInput], list[int]]:
    """The distinct images (by pixel bytes and grid) in first-seen order, and for each input
    image the index of its distinct one. Equal objects are hashed once."""
    digests: dict[int, bytes] = {}
    first: dict[bytes, int] = {}
    kept: list[VisionInput] = []
    index_N: list[int] = []
    for img in images:
        if id(img) not in digests:
            digests[id(img)] = image_digest(img)
        key = digests[id(img)]
        if key not in first:
            first[key] = len(kept)
            kept.append(img)
        index_N.append(first[key])
    return kept, index_N


@cache
def takes_encoder_outputs(model_class: type[torch.nn.Module]) -> bool:
    """Whether this Qwen3-VL model class takes precomputed `mm_encoder_outputs` (transformers
    >= 5.20); older versions get every image's pixels instead."""
    return "mm_encoder_outputs" in inspect.signature(model_class.forward).parameters


def vision_inputs(model: Any, batch: Batch) -> dict[str, Any]:
    """The image arguments of a forward over `batch`: its pixels, or (distinct images) the
    vision tower's output on them, repeated to every occurrence, as mm_encoder_outputs."""
    if batch.image_index_N is None:
        return {"pixel_values": batch.pixel_values, "image_grid_thw": batch.grid_thw_N3}
    enc = core_model(model).get_image_features(batch.pixel_values, batch.grid_thw_N3,
                                               return_dict=True)
    index = batch.image_index_N
    enc.pooler_output = [enc.pooler_output[i] for i in index]
    enc.deepstack_features = [[feats[i] for i in index] for feats in enc.deepstack_features]
    return {"mm_encoder_outputs": {"image": enc}}


def forward_logits(model: Any, batch: Batch, **kwargs: Any) -> Any:
    """One forward pass over a batch; returns the model output (logits_BLV, cache)."""
    return model(
        input_ids=batch.input_ids_BL,
        attention_mask=batch.attention_mask_BL,
        position_ids=batch.position_ids_3BL,
        mm_token_type_ids=batch.mm_types_BL,
        **vision_inputs(model, batch),
        **kwargs,
    )


def masked_log_softmax(
    logits_BV: torch.Tensor, temperature: float, banned: tuple[int, ...]
) -> torch.Tensor:
    """log p over the vocabulary at `temperature` (1.0 for greedy), banned tokens at -inf."""
    scaled = logits_BV.float() / (temperature if temperature > 0 else 1.0)
    if banned:
        scaled = scaled.index_fill(-1, torch.tensor(banned, device=scaled.device), float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def token_logprobs(
    model: Any,
    streams: list[Stream],
    temperature: float,
    banned: tuple[int, ...],
    pad_id: int,
    keep_B_T: list[list[bool]] | None = None,
    share_prefix: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token log-probs of each stream's own tokens (position 0 gets 0) and entropies.

    Returns two lists of B tensors of length T_b; differentiable when grads are enabled.
    `keep_B_T` (e.g. the loss mask) computes the lm_head only at the kept tokens; the others get
    0 (log-prob and entropy). With a 151936-word vocabulary that is most of the memory of a
    training step: the reply tokens are a few percent of an episode. `share_prefix` runs the
    prompt before the first sampled token once for each group of streams that share it (the G
    episodes of a maze: `prefix_groups`) and continues every stream from its group's KV cache:
    the same values (to float rounding) and gradients (summed over the group through the cache).
    """
    multiple = getattr(base_model(model), "train_length_multiple", 1)
    p, group_B = prefix_groups(streams, vision_merge(model)) if share_prefix and multiple == 1 \
        else (0, [])
    if group_B and len(set(group_B)) < len(streams):
        hidden_BLD, lengths_B, ids_BL = _shared_prefix_hidden(model, streams, pad_id, p, group_B)
    else:
        batch = make_batch(model, streams, pad_id, left=False, distinct_images=True,
                           multiple=multiple)
        # Right padding + causal attention: real tokens never see the pads, so no mask is
        # needed, and SDPA takes its fused causal kernel (identical values on real tokens).
        hidden_BLD = base_model(model).model(
            input_ids=batch.input_ids_BL, position_ids=batch.position_ids_3BL,
            mm_token_type_ids=batch.mm_types_BL, use_cache=False, **vision_inputs(model, batch),
        ).last_hidden_state
        lengths_B, ids_BL = batch.lengths_B, batch.input_ids_BL
    if keep_B_T is not None:
        return _kept_logprobs(model, hidden_BLD, ids_BL, lengths_B, keep_B_T, temperature,
                              banned)
    logits_BLV = base_model(model).lm_head(hidden_BLD)
    logp_BLV = masked_log_softmax(logits_BLV[:, :-1], temperature, banned)
    picked_BL = logp_BLV.gather(-1, ids_BL[:, 1:].unsqueeze(-1)).squeeze(-1)
    finite = torch.where(torch.isfinite(logp_BLV), logp_BLV, torch.zeros_like(logp_BLV))
    entropy_BL = -(logp_BLV.exp() * finite).sum(-1)
    zero = picked_BL.new_zeros(len(streams), 1)
    picked_BL = torch.cat([zero, picked_BL], dim=1)
    entropy_BL = torch.cat([zero, entropy_BL], dim=1)
    logps = [picked_BL[b, :n] for b, n in enumerate(lengths_B)]
    entropies = [entropy_BL[b, :n] for b, n in enumerate(lengths_B)]
    return logps, entropies


def prefix_groups(streams: list[Stream], merge: int) -> tuple[int, list[int]]:
    """(p, group_B): p, the length of the prompt before any stream's first sampled token (it
    ends with the assistant header, never inside an image), and for each stream the index of
    the first stream whose first p tokens, and the images among them, equal its own. (0, [])
    when a stream has no sampled token. `merge`: the vision merge size (merge**2 patches a
    token)."""
    if not all(1 in s.loss_mask_T for s in streams):
        return 0, []
    p = min(s.loss_mask_T.index(1) for s in streams)
    first: dict[tuple, int] = {}
    group_B = []
    for b, s in enumerate(streams):
        images = _prefix_images(s, p, merge)
        key = (tuple(s.tokens_T[:p]), tuple(image_digest(img) for img in images))
        group_B.append(first.setdefault(key, b))
    return p, group_B


def _prefix_images(stream: Stream, p: int, merge: int) -> tuple[VisionInput, ...]:
    """The images whose tokens lie in the stream's first p tokens."""
    tokens, kept = sum(stream.mm_types_T[:p]), []
    for img in stream.images:
        n = img.n_patches // merge**2
        if tokens < n:
            break
        kept.append(img)
        tokens -= n
    return tuple(kept)


def vision_merge(model: Any) -> int:
    """The vision tower's spatial merge size."""
    return int(core_model(model).config.vision_config.spatial_merge_size)


def _shared_prefix_hidden(model: Any, streams: list[Stream], pad_id: int, p: int,
                          group_B: list[int]) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Last hidden states of every stream, with the first p tokens run once per prefix group:
    the groups' prefixes as one batch (their KV cache kept, with grad), the cache's rows
    repeated to every stream of a group, then every stream's tokens after p on top of it."""
    ids_BL, _, types_BL, lengths_B = token_tables(streams, pad_id, left=False)
    images = [img for s in streams for img in s.images]
    positions_3BL, _ = core_model(model).get_rope_index(
        ids_BL, mm_token_type_ids=types_BL,
        image_grid_thw=torch.stack([i.grid_thw for i in images]) if images else None)
    device, merge = model.device, vision_merge(model)
    ids_BL, types_BL, positions_3BL = ids_BL.to(device), types_BL.to(device), \
        positions_3BL.to(device)
    heads = sorted(set(group_B))
    row_B = torch.tensor([heads.index(g) for g in group_B], device=device)
    text = base_model(model).model
    before = [len(_prefix_images(s, p, merge)) for s in streams]
    out = text(input_ids=ids_BL[heads, :p], position_ids=positions_3BL[:, heads, :p],
               mm_token_type_ids=types_BL[heads, :p], use_cache=True,
               **_image_kwargs(model, [i for h in heads for i in streams[h].images[:before[h]]]))
    cache = out.past_key_values
    cache.batch_select_indices(row_B)
    tail = text(input_ids=ids_BL[:, p:], position_ids=positions_3BL[:, :, p:],
                mm_token_type_ids=types_BL[:, p:], past_key_values=cache, use_cache=True,
                **_image_kwargs(model, [i for s, n in zip(streams, before) for i in s.images[n:]]))
    hidden_BLD = torch.cat([out.last_hidden_state[row_B], tail.last_hidden_state], dim=1)
    return hidden_BLD, lengths_B, ids_BL


def _image_kwargs(model: Any, images: list[VisionInput]) -> dict[str, Any]:
    """The vision arguments of a forward over these images, each distinct one encoded once."""
    if not images:
        return {}
    index = None
    if takes_encoder_outputs(type(core_model(model))):  # type: ignore[arg-type]
        images, index = distinct(images)
    device = model.device
    batch = Batch(input_ids_BL=torch.empty(0), attention_mask_BL=None, mm_types_BL=torch.empty(0),
                  position_ids_3BL=torch.empty(0),
                  pixel_values=torch.cat([i.pixel_values for i in images]).to(device, model.dtype),
                  grid_thw_N3=torch.stack([i.grid_thw for i in images]).to(device),
                  lengths_B=[], left_padded=False, image_index_N=index)
    return vision_inputs(model, batch)


def _kept_logprobs(model: Any, hidden_BLD: torch.Tensor, ids_BL: torch.Tensor,
                   lengths_B: list[int], keep_B_T: list[list[bool]], temperature: float,
                   banned: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """token_logprobs with the lm_head applied only where keep_B_T is True (position 0 never)."""
    base = base_model(model)
    B, L = ids_BL.shape
    keep_BL = torch.zeros(B, L, dtype=torch.bool)
    for b, keep in enumerate(keep_B_T):
        keep_BL[b, : len(keep)] = torch.tensor(keep, dtype=torch.bool)
    keep_BL[:, 0] = False
    b_N, t_N = keep_BL.nonzero(as_tuple=True)  # target token t is predicted at t - 1
    b_N, t_N = b_N.to(hidden_BLD.device), t_N.to(hidden_BLD.device)
    logits_NV = base.lm_head(hidden_BLD[b_N, t_N - 1])
    logp_NV = masked_log_softmax(logits_NV, temperature, banned)
    picked_N = logp_NV.gather(-1, ids_BL[b_N, t_N].unsqueeze(-1)).squeeze(-1)
    finite = torch.where(torch.isfinite(logp_NV), logp_NV, torch.zeros_like(logp_NV))
    entropy_N = -(logp_NV.exp() * finite).sum(-1)
    zeros_BL = torch.zeros(B, L, dtype=picked_N.dtype, device=picked_N.device)
    picked_BL = zeros_BL.index_put((b_N, t_N), picked_N)
    entropy_BL = zeros_BL.index_put((b_N, t_N), entropy_N)
    logps = [picked_BL[b, :n] for b, n in enumerate(lengths_B)]
    entropies = [entropy_BL[b, :n] for b, n in enumerate(lengths_B)]
    return logps, entropies
