"""Batched forward passes over streams, and the one log-probability rule sampler and trainer share.

`token_logprobs` is the single definition of a token's log-probability: logits divided by the
sampling temperature, the banned (vision special) tokens removed, log-softmax. The sampler
reports it for every token it draws; the trainer recomputes it over the same stream. Before any
update the two agree within float tolerance (tests/test_policy.py pins it).

The trainer runs the decoder on inputs it builds itself (`decoder_inputs`): each distinct image
(`image_digest`) goes through the vision tower once, since the G episodes of a maze see the
same squares again and again and an image's features do not depend on where it sits; its
features are repeated to every occurrence and put in place of the image's pad tokens, as
transformers' own Qwen3-VL forward does. The gradient of a repeated image is the sum over its
uses, as without the sharing, and no transformers version is needed beyond the decoder's own
DeepStack inputs.

The trainer's path never makes the host wait for the GPU before its backward is launched
(`token_logprobs` without share_prefix): every table is built on the CPU and `upload`ed without
a wait, the vision tower gets its position tables precomputed (`vision_tables`), and image
features and DeepStack features go to their pads by index (`index_deepstack`) instead of by
boolean mask, whose indexing reads the mask's count back. So a session can launch the next
update call while the GPU still runs the one before (`session.inprocess`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workbench.policy.stream import Stream, VisionInput


@dataclass
class Batch:
    """Padded model inputs for B streams of up to L tokens."""

    input_ids_BL: torch.Tensor
    attention_mask_BL: torch.Tensor | None
    mm_types_BL: torch.Tensor
    position_ids_3BL: torch.Tensor  # M-RoPE positions (temporal, height, width)
    pixel_values: torch.Tensor | None  # all images, stream order then image order
    grid_thw_N3: torch.Tensor | None
    lengths_B: list[int]
    left_padded: bool


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
               multiple: int = 1) -> Batch:
    """Pad streams to one batch (left padding for sampling, right for training) of a length that
    is a multiple of `multiple`."""
    ids, mask, types, lengths = token_tables(streams, pad_id, left, multiple)
    images = [img for s in streams for img in s.images]
    positions = rope_positions(model, ids, types, images, mask)
    device = model.device
    return Batch(
        input_ids_BL=ids.to(device),
        attention_mask_BL=mask.to(device),
        mm_types_BL=types.to(device),
        position_ids_3BL=positions.to(device),
        pixel_values=torch.cat([i.pixel_values for i in images]).to(device, model.dtype)
        if images else None,
        grid_thw_N3=torch.stack([i.grid_thw for i in images]).to(device) if images else None,
        lengths_B=lengths,
        left_padded=left,
    )


def rope_positions(model: Any, ids_BL: torch.Tensor, types_BL: torch.Tensor,
                   images: list[VisionInput], mask_BL: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The M-RoPE positions (3, B, L) of padded token ids holding these images' pads, in order
    (the model's own rule, on the CPU tensors given)."""
    grid = torch.stack([i.grid_thw for i in images]) if images else None
    positions, _ = core_model(model).get_rope_index(
        ids_BL, mm_token_type_ids=types_BL, image_grid_thw=grid, attention_mask=mask_BL)
    return positions


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
    """What makes two images the same for the trainer: the RGB image their pixels were made from,
    where they carry it (`encode_image` keeps it; a tenth of the pixels' bytes at the 8B shape,
    hashed in every update call), else their pixels; with the pixels' shape and grid either
    way. Images of either kind are never the same as one of the other."""
    source, kind = image.image_HW3, b"rgb"
    if source is None:
        source, kind = image.pixel_values.contiguous().numpy(), b"pixels"
    digest = hashlib.sha1(kind)
    digest.update(np.ascontiguousarray(source).data)
    digest.update(repr((source.shape, tuple(image.pixel_values.shape))).encode())
    digest.update(image.grid_thw.numpy().tobytes())
    return digest.digest()


def distinct(images: list[VisionInput]) -> tuple[list[VisionInput], list[int]]:
    """The distinct images (by `image_digest`) in first-seen order, and for each input image
    the index of its distinct one. Equal objects are hashed once."""
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


def upload(t: torch.Tensor, device: Any) -> torch.Tensor:
    """A CPU tensor on `device` without making the host wait: to a CUDA device through pinned
    memory and a non-blocking copy (a plain copy from pageable memory synchronises the stream,
    so the host would first wait for every kernel queued before it); elsewhere `.to(device)`."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def vision_tables(visual: Any, grid_N3: torch.Tensor, device: Any) -> dict[str, Any]:
    """The vision tower's per-image tables (position-embedding taps and weights, rotary
    positions, packed sequence bounds) computed on the CPU from the images' grids (CPU) by
    transformers' own functions, as keyword arguments its forward takes instead of computing
    them on the device, where each needs the grids read back first. The bounds stay on the CPU
    (the SDPA tower reads them there: `model.vision`). {} for a non-SDPA tower."""
    from transformers import vision_utils

    if visual.config._attn_implementation != "sdpa":
        return {}
    merge = visual.config.spatial_merge_size
    taps, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid_N3, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=merge)
    return {"interp_indices": upload(taps, device), "interp_weights": upload(weights, device),
            "position_ids": upload(vision_utils.get_vision_position_ids(grid_N3, merge), device),
            "cu_seqlens": vision_utils.get_vision_cu_seqlens(grid_N3)}


def index_deepstack(text_model: Any) -> None:
    """Let a Qwen3-VL text model take its DeepStack positions as flat indices into (B * L)
    (`decoder_inputs` passes them as `visual_pos_masks`): the features are added there by
    index_add, whose forward and backward need no host read; a boolean mask still goes through
    transformers' own function. Installed once per model instance."""
    if getattr(text_model, "index_deepstack", False):
        return
    by_mask = text_model._deepstack_process

    def deepstack(hidden_BLD: torch.Tensor, positions: torch.Tensor,
                  visual_ND: torch.Tensor) -> torch.Tensor:
        if positions.dtype == torch.bool:
            return by_mask(hidden_BLD, positions, visual_ND)
        flat_ND = hidden_BLD.reshape(-1, hidden_BLD.shape[-1])
        return flat_ND.index_add(0, positions, visual_ND.to(flat_ND.dtype)).view_as(hidden_BLD)

    text_model._deepstack_process = deepstack
    text_model.index_deepstack = True


def decoder_inputs(model: Any, ids_BL: torch.Tensor, images: list[VisionInput]
                   ) -> dict[str, Any]:
    """The decoder's (`language_model`'s) inputs for token ids ids_BL (CPU) holding the pads of
    `images`, in order: token embeddings with each image's features in place of its pads, the
    pads' flat positions, and the DeepStack features at them. Each distinct image is encoded
    once (the module docstring); ValueError when the pads and the images' tokens differ in
    number. Nothing here waits for the GPU."""
    core = core_model(model)
    device = model.device
    embeds_BLD = core.get_input_embeddings()(upload(ids_BL, device))
    if not images:
        return {"inputs_embeds": embeds_BLD}
    kept, index_N = distinct(images)
    rows_R = feature_rows(kept, index_N, vision_merge(model))
    pads_R = (ids_BL.reshape(-1) == core.config.image_token_id).nonzero().squeeze(1)
    if len(pads_R) != len(rows_R):
        raise ValueError(f"{len(pads_R)} image pad tokens for {len(images)} images of "
                         f"{len(rows_R)} tokens: the stream and its images disagree")
    grid_N3 = torch.stack([i.grid_thw for i in kept])
    pixels = upload(torch.cat([i.pixel_values for i in kept]), device).to(core.visual.dtype)
    vision = core.visual(pixels, grid_thw=upload(grid_N3, device), return_dict=True,
                         **vision_tables(core.visual, grid_N3, device))
    rows_R, pads_R = upload(rows_R, device), upload(pads_R, device)
    index_deepstack(core.language_model)
    flat_ND = embeds_BLD.reshape(-1, embeds_BLD.shape[-1])
    features_RD = vision.pooler_output[rows_R].to(flat_ND.dtype)
    return {"inputs_embeds": flat_ND.index_copy(0, pads_R, features_RD).view_as(embeds_BLD),
            "visual_pos_masks": pads_R,
            "deepstack_visual_embeds": [f[rows_R] for f in vision.deepstack_features]}


def feature_rows(kept: list[VisionInput], index_N: list[int], merge: int) -> torch.Tensor:
    """For each image occurrence in order (occurrence n is distinct image index_N[n]), the rows
    of its features in the vision tower's output over the distinct images."""
    sizes = np.array([img.n_patches // merge**2 for img in kept])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return torch.from_numpy(np.concatenate([np.arange(starts[j], starts[j] + sizes[j])
                                            for j in index_N]))


def forward_logits(model: Any, batch: Batch, **kwargs: Any) -> Any:
    """One forward pass over a batch; returns the model output (logits_BLV, cache)."""
    return model(
        input_ids=batch.input_ids_BL,
        attention_mask=batch.attention_mask_BL,
        position_ids=batch.position_ids_3BL,
        mm_token_type_ids=batch.mm_types_BL,
        pixel_values=batch.pixel_values,
        image_grid_thw=batch.grid_thw_N3,
        **kwargs,
    )


def masked_log_softmax(
    logits_BV: torch.Tensor, temperature: float, banned: tuple[int, ...]
) -> torch.Tensor:
    """log p over the vocabulary at `temperature` (1.0 for greedy), banned tokens at -inf."""
    scaled = logits_BV.float() / (temperature if temperature > 0 else 1.0)
    if banned:
        scaled = scaled.index_fill(-1, upload(torch.tensor(banned), scaled.device), float("-inf"))
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
        ids_BL, _, types_BL, lengths_B = token_tables(streams, pad_id, False, multiple)
        images = [img for s in streams for img in s.images]
        positions_3BL = rope_positions(model, ids_BL, types_BL, images)
        # Right padding + causal attention: real tokens never see the pads, so no mask is
        # needed, and SDPA takes its fused causal kernel (identical values on real tokens).
        hidden_BLD = core_model(model).language_model(
            position_ids=upload(positions_3BL, model.device), use_cache=False,
            **decoder_inputs(model, ids_BL, images)).last_hidden_state
        ids_BL = upload(ids_BL, model.device)
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
    positions_3BL = rope_positions(model, ids_BL, types_BL,
                                   [img for s in streams for img in s.images])
    device, merge = model.device, vision_merge(model)
    positions_3BL = upload(positions_3BL, device)
    heads = sorted(set(group_B))
    row_B = upload(torch.tensor([heads.index(g) for g in group_B]), device)
    text = core_model(model).language_model
    before = [len(_prefix_images(s, p, merge)) for s in streams]
    out = text(position_ids=positions_3BL[:, heads, :p], use_cache=True,
               **decoder_inputs(model, ids_BL[heads, :p],
                                [i for h in heads for i in streams[h].images[:before[h]]]))
    cache = out.past_key_values
    cache.batch_select_indices(row_B)
    tail = text(position_ids=positions_3BL[:, :, p:], past_key_values=cache, use_cache=True,
                **decoder_inputs(model, ids_BL[:, p:],
                                 [i for s, n in zip(streams, before) for i in s.images[n:]]))
    hidden_BLD = torch.cat([out.last_hidden_state[row_B], tail.last_hidden_state], dim=1)
    return hidden_BLD, lengths_B, upload(ids_BL, device)


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
    b_N, t_N = upload(b_N, hidden_BLD.device), upload(t_N, hidden_BLD.device)
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
