"""Multi-turn conversation token streams, built only by appending.

A `Stream` is the exact token sequence the policy saw and produced in one episode, in Qwen-VL's
chat format:

    <|im_start|>system\\n{rules}<|im_end|>\\n
    <|im_start|>user\\n<|vision_start|><|image_pad|>*n<|vision_end|>{feedback}<|im_end|>\\n
    <|im_start|>assistant\\n{sampled reply ... <|im_end|>}\\n
    <|im_start|>user\\n ... (next turn)

Each turn appends tokens; history is never re-rendered (re-rendering can change tokens and take
the update silently off-policy). Beside the tokens the stream keeps a per-token modality type
(0 text, 1 image), a loss mask (1 on sampled reply tokens only), the sampler's log-probabilities
(0 elsewhere), and each image's processed pixels (and the RGB image they came from), so the
trainer can re-run it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class ChatFormat:
    """Token ids of the chat markup, read from a processor's tokenizer."""

    im_start: int
    im_end: int
    newline: list[int]
    vision_start: int
    vision_end: int
    image_pad: int
    banned: tuple[int, ...]  # tokens the sampler never emits (vision specials, pad, im_start)
    merge: int  # spatial merge size: image tokens = t * h * w / merge**2


@dataclass(frozen=True)
class VisionInput:
    """One image as the vision tower takes it."""

    pixel_values: torch.Tensor  # (patches, channels * temporal * patch * patch)
    grid_thw: torch.Tensor  # (3,) temporal, height, width in patches
    image_HW3: np.ndarray | None = field(default=None, compare=False, repr=False)
    # the RGB uint8 image these pixels came from (engines that run their own image
    # processor, such as vLLM, take this)

    @property
    def n_patches(self) -> int:
        """Vision patches; the text stream holds n_patches / merge**2 image tokens."""
        return int(self.grid_thw.prod().item())


@dataclass(frozen=True)
class Stream:
    """One conversation's tokens and per-token side tables, all of length T."""

    tokens_T: list[int] = field(default_factory=list)
    mm_types_T: list[int] = field(default_factory=list)  # 0 text, 1 image
    loss_mask_T: list[int] = field(default_factory=list)  # 1 = sampled (trainable) token
    logprobs_T: list[float] = field(default_factory=list)  # sampler log-prob, 0.0 elsewhere
    images: tuple[VisionInput, ...] = ()

    def __len__(self) -> int:
        return len(self.tokens_T)

    def __repr__(self) -> str:
        """One line (the tables and pixels stay out of a notebook's output)."""
        return (f"Stream(T={len(self.tokens_T)} tokens, {sum(self.loss_mask_T)} sampled, "
                f"{len(self.images)} images)")

    def reply_index_T(self) -> list[int]:
        """Per token, the index of the reply (a run of loss-mask tokens: one per turn of a
        rollout) it belongs to; -1 for tokens outside the replies."""
        out, reply = [], -1
        for t, m in enumerate(self.loss_mask_T):
            if m and (t == 0 or not self.loss_mask_T[t - 1]):
                reply += 1
            out.append(reply if m else -1)
        return out


def chat_format(processor: Any) -> ChatFormat:
    """Read the chat markup ids from a Qwen-VL processor (tiny or real)."""
    tok = processor.tokenizer
    ids = {name: tok.convert_tokens_to_ids(name) for name in (
        "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
        "<|video_pad|>", "<|vision_pad|>", "<|endoftext|>",
    )}
    banned = tuple(sorted({
        ids["<|vision_start|>"], ids["<|vision_end|>"], ids["<|image_pad|>"],
        ids["<|video_pad|>"], ids["<|vision_pad|>"], ids["<|endoftext|>"], ids["<|im_start|>"],
    }))
    return ChatFormat(
        im_start=ids["<|im_start|>"],
        im_end=ids["<|im_end|>"],
        newline=tok.encode("\n", add_special_tokens=False),
        vision_start=ids["<|vision_start|>"],
        vision_end=ids["<|vision_end|>"],
        image_pad=ids["<|image_pad|>"],
        banned=banned,
        merge=processor.image_processor.merge_size,
    )


def encode_image(processor: Any, image_HW3: np.ndarray) -> VisionInput:
    """The processor's image pipeline on one RGB uint8 image. An image the processor would not
    resize (`keeps_size`: the tiny default's mazes) is normalised through a 256-entry table and
    cut into patches here (`patchify`): the processor's exact values, about 20x faster."""
    ip = processor.image_processor
    if keeps_size(ip, image_HW3.shape[0], image_HW3.shape[1]):
        return VisionInput(patchify(ip, image_HW3), torch.tensor(
            [1, image_HW3.shape[0] // ip.patch_size, image_HW3.shape[1] // ip.patch_size]),
            image_HW3=image_HW3)
    out = ip(images=[image_HW3], return_tensors="pt")
    return VisionInput(pixel_values=out["pixel_values"], grid_thw=out["image_grid_thw"][0],
                       image_HW3=image_HW3)


def keeps_size(image_processor: Any, height: int, width: int) -> bool:
    """Whether a Qwen-VL image processor keeps an image of this size as it is (sides multiples
    of patch * merge, pixels within its bounds) and only rescales and normalises it."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    ip = image_processor
    if not (ip.do_rescale and ip.do_normalize and ip.rescale_factor == 1 / 255):
        return False
    if not ip.do_resize:
        return height % ip.patch_size == 0 and width % ip.patch_size == 0
    factor = ip.patch_size * ip.merge_size
    bounds = ip.size["shortest_edge"], ip.size["longest_edge"]
    return smart_resize(height, width, factor, *bounds) == (height, width)


def patchify(image_processor: Any, image_HW3: np.ndarray) -> torch.Tensor:
    """(patches, channels * temporal * patch * patch) pixels of an image the processor keeps at
    its size, in the processor's patch order, with its normalisation's exact float32 values."""
    ip = image_processor
    P, M, T = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    H, W, C = image_HW3.shape
    table_256C = _normalise_table(tuple(ip.image_mean), tuple(ip.image_std), ip.rescale_factor)
    image_HWC = table_256C[image_HW3, np.arange(C)]
    patches = image_HWC.reshape(H // P // M, M, P, W // P // M, M, P, C).transpose(
        0, 3, 1, 4, 6, 2, 5)  # (h blocks, w blocks, merge rows, merge cols, C, P, P)
    out = np.broadcast_to(patches[:, :, :, :, :, None], patches.shape[:5] + (T, P, P))
    return torch.from_numpy(out.reshape((H // P) * (W // P), C * T * P * P))


@cache
def _normalise_table(mean: tuple[float, ...], std: tuple[float, ...],
                     rescale: float) -> np.ndarray:
    """Each uint8 value normalised as the processor does it (rescale fused into the mean and
    std: x - mean / rescale, divided by std / rescale, in float32): (256, channels)."""
    values_256C = torch.arange(256, dtype=torch.float32)[:, None].repeat(1, len(mean))
    table = values_256C.sub_(torch.tensor(mean) * (1.0 / rescale)).div_(
        torch.tensor(std) * (1.0 / rescale))
    return table.numpy()


def _append(
    stream: Stream,
    tokens: list[int],
    mm_types: list[int] | None = None,
    logprobs: list[float] | None = None,
    images: tuple[VisionInput, ...] = (),
) -> Stream:
    trainable = logprobs is not None
    return replace(
        stream,
        tokens_T=stream.tokens_T + list(tokens),
        mm_types_T=stream.mm_types_T + (mm_types or [0] * len(tokens)),
        loss_mask_T=stream.loss_mask_T + [int(trainable)] * len(tokens),
        logprobs_T=stream.logprobs_T
        + (list(logprobs) if logprobs is not None else [0.0] * len(tokens)),
        images=stream.images + images,
    )


def _text(processor: Any, text: str, cache: dict[str, list[int]] | None = None) -> list[int]:
    """The text's tokens (`cache`: tokens of texts seen before, filled as it goes)."""
    if cache is None:
        return processor.tokenizer.encode(text, add_special_tokens=False)
    if text not in cache:
        cache[text] = processor.tokenizer.encode(text, add_special_tokens=False)
    return cache[text]


def start_stream(processor: Any, fmt: ChatFormat, system_text: str) -> Stream:
    """A new stream holding the system message."""
    tokens = [fmt.im_start, *_text(processor, "system\n" + system_text), fmt.im_end, *fmt.newline]
    return _append(Stream(), tokens)


def append_user(
    stream: Stream,
    processor: Any,
    fmt: ChatFormat,
    text: str,
    image: VisionInput | None = None,
    texts: dict[str, list[int]] | None = None,
) -> Stream:
    """Append a user turn (optional image first, then text) and open the assistant turn.
    `texts` keeps the tokens of each text seen (a rollout's recurring lines are encoded once)."""
    head = [fmt.im_start, *_text(processor, "user\n", texts)]
    vision, vision_types = [], []
    if image is not None:
        n = image.n_patches // fmt.merge**2
        vision = [fmt.vision_start, *[fmt.image_pad] * n, fmt.vision_end]
        vision_types = [0, *[1] * n, 0]
    tail = [*_text(processor, text, texts), fmt.im_end, *fmt.newline, fmt.im_start]
    tail += _text(processor, "assistant\n", texts)
    tokens = head + vision + tail
    types = [0] * len(head) + vision_types + [0] * len(tail)
    return _append(stream, tokens, types, images=(image,) if image is not None else ())


def keep_last_images(stream: Stream, fmt: ChatFormat, k: int) -> Stream:
    """The stream with only its last k images: each older image's tokens (<|vision_start|>, its
    <|image_pad|> run, <|vision_end|>) and pixels are cut out, every other token is kept as it
    is (the text of each turn stays). A stream with k or fewer images is returned as it is."""
    drop = len(stream.images) - k
    if drop <= 0:
        return stream
    keep_T: list[bool] = []
    image, inside, cut = 0, False, False
    for token in stream.tokens_T:
        if token == fmt.vision_start:  # an image's span: <|vision_start|> ... <|vision_end|>
            inside, cut = True, image < drop
            image += 1
        keep_T.append(not (inside and cut))
        if token == fmt.vision_end:
            inside = False
    pick = [t for t, keep in enumerate(keep_T) if keep]
    return Stream(tokens_T=[stream.tokens_T[t] for t in pick],
                  mm_types_T=[stream.mm_types_T[t] for t in pick],
                  loss_mask_T=[stream.loss_mask_T[t] for t in pick],
                  logprobs_T=[stream.logprobs_T[t] for t in pick],
                  images=stream.images[drop:])


def append_reply(
    stream: Stream, fmt: ChatFormat, tokens: list[int], logprobs: list[float]
) -> Stream:
    """Append the sampled reply (trainable) and close the turn; a reply cut by length gets
    a masked <|im_end|> so the next turn starts on a clean boundary."""
    stream = _append(stream, tokens, logprobs=logprobs)
    closing = [] if tokens and tokens[-1] == fmt.im_end else [fmt.im_end]
    return _append(stream, closing + fmt.newline)
