"""A batched transformers sampler that keeps each stream's KV cache across turns.

Streams only grow by appending, so the cache of everything already seen stays valid: each turn
prefills only the new tokens (feedback, the new image, the assistant header) and decodes the reply.
One batched cache holds B live rows; rows have different lengths, so the cache has holes (left
padding of a turn's chunk, tokens fed after a row already finished) that the attention mask hides.
Positions are explicit M-RoPE ids, advanced only by real tokens, so holes do not shift them.

A `deadline` (time.monotonic() seconds) stops decoding with DeadlineExceeded: it is checked
after the prefill and between decode steps, so it is passed by at most one model call.

Each drawn token's log-probability is reported under the rule the trainer uses
(`forward.masked_log_softmax`: temperature, vision special tokens banned); greedy decoding
(temperature 0) reports log-probabilities at temperature 1. Randomness comes only from the
`torch.Generator` passed in.

    live = open_batch()
    extend(model, live, streams, pad_id)
    completions = decode(model, live, fmt, params, generator)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from workbench.policy.engine import Completion, DeadlineExceeded, SamplingParams
from workbench.policy.forward import core_model, masked_log_softmax
from workbench.policy.stream import ChatFormat, Stream
from workbench.sampler.kvcache import growable_cache

OnStep = Callable[[list[int], list[int], list[float]], None]
"""A decode step's rows still replying, the token each drew and its log-prob (row b is
sample b % n of prompt b // n)."""


@dataclass
class LiveBatch:
    """KV cache and bookkeeping for B live streams (rows)."""

    cache: Any = field(default_factory=growable_cache)
    mask_BL: torch.Tensor | None = None  # 1 = real stream token in the cache, 0 = hole
    next_pos_B: torch.Tensor | None = None  # M-RoPE position of each row's next token
    consumed_B: list[int] = field(default_factory=list)  # stream tokens already in the cache
    images_B: list[int] = field(default_factory=list)  # stream images already in the cache
    logits_BV: torch.Tensor | None = None  # next-token logits after each row's last real token
    feed: Any = None  # feed(model, live, tok_B, real_B) for decode steps; None = eager `_feed`

    @property
    def rows(self) -> int:
        return len(self.consumed_B)


def open_batch() -> LiveBatch:
    """An empty batch; the first `extend` sets its rows."""
    return LiveBatch()


def _chunk_inputs(streams: list[Stream], live: LiveBatch, pad_id: int) -> dict[str, Any]:
    """Left-padded new tokens of each row, their modality types and their new images."""
    starts = live.consumed_B or [0] * len(streams)
    first_img = live.images_B or [0] * len(streams)
    chunks = [s.tokens_T[c:] for s, c in zip(streams, starts)]
    L = max(len(c) for c in chunks)
    ids = torch.full((len(streams), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(streams), L), dtype=torch.long)
    types = torch.zeros((len(streams), L), dtype=torch.long)
    for b, (s, c) in enumerate(zip(streams, starts)):
        n = len(s) - c
        if n:
            ids[b, L - n:] = torch.tensor(s.tokens_T[c:])
            types[b, L - n:] = torch.tensor(s.mm_types_T[c:])
            mask[b, L - n:] = 1
    images = [img for s, k in zip(streams, first_img) for img in s.images[k:]]
    return dict(ids=ids, mask=mask, types=types, images=images, empty=[len(c) == 0 for c in chunks])


@torch.no_grad()
def extend(model: Any, live: LiveBatch, streams_B: list[Stream], pad_id: int) -> None:
    """Prefill each row's tokens not yet in the cache (row b is streams_B[b])."""
    x = _chunk_inputs(streams_B, live, pad_id)
    grid = torch.stack([i.grid_thw for i in x["images"]]) if x["images"] else None
    pixels = torch.cat([i.pixel_values for i in x["images"]]) if x["images"] else None
    positions, _ = core_model(model).get_rope_index(
        x["ids"], mm_token_type_ids=x["types"], image_grid_thw=grid, attention_mask=x["mask"]
    )
    B, device = len(streams_B), model.device
    next_pos = live.next_pos_B if live.next_pos_B is not None else torch.zeros(B, dtype=torch.long)
    positions = positions + next_pos.view(1, B, 1)
    mask_BL = x["mask"] if live.mask_BL is None else torch.cat([live.mask_BL, x["mask"]], 1)
    out = model(
        input_ids=x["ids"].to(device),
        attention_mask=mask_BL.to(device),
        position_ids=positions.to(device),
        past_key_values=live.cache,
        pixel_values=pixels.to(device, model.dtype) if pixels is not None else None,
        image_grid_thw=grid.to(device) if grid is not None else None,
        mm_token_type_ids=x["types"].to(device),
        use_cache=True,
        logits_to_keep=1,  # left padding: the last column is every row's next-token position
    )
    empty = torch.tensor(x["empty"])
    logits = out.logits[:, -1].float()  # stays on the model's device (no copy on the CPU)
    if live.logits_BV is not None:
        logits = torch.where(empty[:, None].to(logits.device), live.logits_BV, logits)
    real_max = torch.where(x["mask"].bool().unsqueeze(0), positions, -1).amax(dim=(0, 2))
    live.next_pos_B = torch.where(empty, next_pos, real_max + 1)
    live.cache, live.mask_BL, live.logits_BV = out.past_key_values, mask_BL, logits
    live.consumed_B = [len(s) for s in streams_B]
    live.images_B = [len(s.images) for s in streams_B]


def device_generator(generator: torch.Generator | None,
                     device: torch.device) -> torch.Generator | None:
    """`generator` itself on the CPU; on an accelerator a generator there, seeded by one draw
    from `generator` (so a seeded rollout stays reproducible without moving logits off it)."""
    if generator is None or device.type == generator.device.type:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.Generator(device).manual_seed(seed)


def _draw(logp_BV: torch.Tensor, greedy: bool, generator: torch.Generator | None) -> torch.Tensor:
    if greedy:
        return logp_BV.argmax(-1)
    return torch.multinomial(logp_BV.exp(), 1, generator=generator).squeeze(-1)


def _feed(model: Any, live: LiveBatch, tok_B: torch.Tensor, real_B: torch.Tensor) -> None:
    """Append one token per row to the cache; rows with real_B False get a hole."""
    B, device = live.rows, model.device
    assert live.mask_BL is not None and live.next_pos_B is not None \
        and live.logits_BV is not None, "an empty batch: extend it first"
    live.mask_BL = torch.cat([live.mask_BL, real_B.long()[:, None]], dim=1)
    out = model(
        input_ids=tok_B[:, None].to(device),
        attention_mask=live.mask_BL.to(device),
        position_ids=live.next_pos_B.view(1, B, 1).expand(3, B, 1).to(device),
        past_key_values=live.cache,
        use_cache=True,
    )
    live.cache = out.past_key_values
    live.logits_BV = torch.where(real_B[:, None].to(device), out.logits[:, -1].float(),
                                 live.logits_BV)
    live.next_pos_B = live.next_pos_B + real_B.long()
    live.consumed_B = [c + int(r) for c, r in zip(live.consumed_B, real_B.tolist())]


@torch.no_grad()
def decode(
    model: Any,
    live: LiveBatch,
    fmt: ChatFormat,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    deadline: float = math.inf,
    on_step: OnStep | None = None,
) -> list[Completion]:
    """Sample one reply per row from the cached state; the reply's tokens enter the cache
    (all but the last, which the next `extend` feeds with the stream). DeadlineExceeded once
    time.monotonic() passes `deadline` before a step. `on_step(rows, tokens, logprobs)` sees each
    step's tokens of the rows still replying (a streamed reply); what it raises stops decoding."""
    greedy = params.temperature <= 0
    assert live.logits_BV is not None, "an empty batch: extend it first"
    generator = device_generator(generator, live.logits_BV.device)
    feed = live.feed or _feed
    tokens_BT: list[list[int]] = [[] for _ in range(live.rows)]
    logps_BT: list[list[float]] = [[] for _ in range(live.rows)]
    done_B = torch.zeros(live.rows, dtype=torch.bool)
    for step in range(params.max_tokens):
        if time.monotonic() > deadline:
            raise DeadlineExceeded(step)
        logp_BV = masked_log_softmax(live.logits_BV, params.temperature, fmt.banned)
        tok_B = _draw(logp_BV, greedy, generator)
        lp_B = logp_BV.gather(-1, tok_B[:, None]).squeeze(-1)
        tok_cpu_B, lp_list = tok_B.cpu(), lp_B.tolist()  # one device sync per step
        live_b = (~done_B).nonzero().flatten().tolist()
        for b in live_b:
            tokens_BT[b].append(int(tok_cpu_B[b]))
            logps_BT[b].append(lp_list[b])
        if on_step is not None:
            on_step(live_b, [tokens_BT[b][-1] for b in live_b], [lp_list[b] for b in live_b])
        was_live_B = ~done_B
        done_B = done_B | (tok_cpu_B == fmt.im_end)
        if bool(done_B.all()) or step == params.max_tokens - 1:
            break
        feed(model, live, tok_B, was_live_B)
    return [
        Completion(t, lp, "stop" if t and t[-1] == fmt.im_end else "length")
        for t, lp in zip(tokens_BT, logps_BT)
    ]


def select_rows(live: LiveBatch, rows: list[int]) -> None:
    """Keep only `rows` (e.g. drop finished episodes)."""
    if rows == list(range(live.rows)):
        return
    index = torch.tensor(rows, dtype=torch.long)
    assert live.mask_BL is not None and live.next_pos_B is not None \
        and live.logits_BV is not None, "an empty batch: extend it first"
    live.cache.batch_select_indices(index.to(live.cache.layers[0].keys.device))
    live.mask_BL = live.mask_BL[index]
    live.next_pos_B = live.next_pos_B[index]
    live.logits_BV = live.logits_BV[index.to(live.logits_BV.device)]
    live.consumed_B = [live.consumed_B[r] for r in rows]
    live.images_B = [live.images_B[r] for r in rows]


def repeat_rows(live: LiveBatch, n: int) -> None:
    """Each row becomes n consecutive rows sharing its cached prefix (G samples per prompt)."""
    select_rows(live, [r for r in range(live.rows) for _ in range(n)])


@torch.no_grad()
def sample(
    model: Any,
    fmt: ChatFormat,
    streams: list[Stream],
    n: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    pad_id: int = 0,
    deadline: float = math.inf,
    on_step: OnStep | None = None,
) -> list[list[Completion]]:
    """Sample `n` replies for each stream (prefilled once): completions_P_n; DeadlineExceeded
    once time.monotonic() passes `deadline`; `on_step` sees each step's tokens (see `decode`)."""
    live = open_batch()
    extend(model, live, streams, pad_id)
    repeat_rows(live, n)
    completions = decode(model, live, fmt, params, generator, deadline, on_step)
    return [completions[p * n:(p + 1) * n] for p in range(len(streams))]
