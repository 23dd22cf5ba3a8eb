"""A streamed row's vLLM requests rendered turn by turn: vLLM's renderer runs on each turn's new
tokens, and the row's last request is extended by them.

vLLM renders every prompt whole before it queues it (`LLM.enqueue`, `LLM.generate`): each image
pad found and expanded to its image's tokens, each image looked up in its processor cache, its
HF processor called, all in Python, in the process that also steps the environments. A
multi-turn row sends its whole stream every turn (vLLM's prefix cache finds its KV), so that
work grows with every turn a row has played.

`RowRequests.engine_input` renders a row's first prompt whole. A later prompt that extends the
row's last one (append-only streams do) is the last request's engine input with vLLM's own
rendering of the new tokens and images appended (`extend_input`): the new placeholders moved
past the old tokens, and the old images sent as vLLM's renderer sends images it rendered before
(`old_items`). A prompt that does not extend the last one (an image window cut the older
images), or whose old images vLLM's cache no longer holds, is rendered whole.

    rows = RowRequests(llm, prompt_of=vllm_prompt)   # one rollout
    llm.llm_engine.add_request(request_id, rows.engine_input(row, stream), params)

vLLM's processor cache on the front end (`llm.renderer.mm_processor_cache`) is one of:

- its IPC sender cache (vLLM's default with its engine core in another process): a mirror of the
  engine core's cache. An image the engine core holds is sent as None, each one touched in the
  request's order, as vLLM's renderer does, so both caches evict alike;
- a front-end-only cache (engine core in this process): every image goes with its processed
  tensors, the ones the last request sent;
- none (`mm_processor_cache_gb=0`): the same, without a cache to touch.

Any other cache (vLLM's shared-memory one) renders every request whole, and says so once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from workbench.deps import warn_fallback
from workbench.policy.stream import Stream

SENDER_CACHE = "MultiModalProcessorSenderCache"  # the engine core holds what it was sent
FRONT_END_CACHE = "MultiModalProcessorOnlyCache"  # every request sends its images' tensors


def render(llm: Any, prompt: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own rendering of one TokensPrompt: the engine input `LLM.enqueue` would queue."""
    (engine_input,) = llm.renderer.render_cmpl([prompt])
    return engine_input


def grown_from(stream: Stream, last: Stream) -> bool:
    """`stream` is `last` with tokens (and images) appended, its images `last`'s own objects
    (stricter than `policy.engine.extends`, which compares tokens only)."""
    n, k = len(last.tokens_T), len(last.images)
    return (len(stream.tokens_T) > n and stream.tokens_T[:n] == last.tokens_T
            and len(stream.images) >= k
            and all(a is b for a, b in zip(stream.images, last.images)))


def tail(stream: Stream, start: int, images: int) -> Stream:
    """The stream's tokens from `start` on, with its images from index `images` on."""
    return Stream(stream.tokens_T[start:], stream.mm_types_T[start:], stream.loss_mask_T[start:],
                  stream.logprobs_T[start:], stream.images[images:])


def image_fields(engine_input: dict[str, Any], key: str) -> list[Any]:
    """An engine input's image entries under `key` (mm_kwargs, mm_hashes, mm_placeholders);
    [] for a text-only input. Only images: another modality raises."""
    fields = engine_input.get(key) or {}
    if set(fields) - {"image"}:
        raise ValueError(f"a row's requests hold only images; this one has {sorted(fields)}")
    return list(fields.get("image", []))


def old_items(cache: Any, engine_input: dict[str, Any]) -> list[Any] | None:
    """The last request's images as the next request sends them, in order: None for each one
    the engine core holds (sender cache: each touched, in order, as vLLM's renderer does), else
    the tensors the last request sent; None (render it whole) if the cache evicted one."""
    hashes, items = image_fields(engine_input, "mm_hashes"), image_fields(engine_input, "mm_kwargs")
    if cache is None:
        return items
    if not all(cache.is_cached_item(h) for h in hashes):
        return None
    for h in hashes:
        cache.touch_sender_cache_item(h)
    return [None] * len(items) if type(cache).__name__ == SENDER_CACHE else items


def extend_input(last: dict[str, Any], new: dict[str, Any], items: list[Any]) -> dict[str, Any]:
    """The engine input of `last`'s prompt followed by `new`'s (rendered on its own): tokens
    joined, `new`'s placeholders moved past `last`'s tokens, `last`'s images sent as `items`."""
    ids = last["prompt_token_ids"] + new["prompt_token_ids"]
    if "mm_hashes" not in last and "mm_hashes" not in new:
        return {**new, "prompt_token_ids": ids}
    base = len(last["prompt_token_ids"])
    kwargs_cls = type(last["mm_kwargs"] if "mm_kwargs" in last else new["mm_kwargs"])
    moved = [replace(p, offset=p.offset + base) for p in image_fields(new, "mm_placeholders")]
    hashes = image_fields(last, "mm_hashes") + image_fields(new, "mm_hashes")
    return {**new, "type": "multimodal", "prompt_token_ids": ids,
            "mm_kwargs": kwargs_cls({"image": items + image_fields(new, "mm_kwargs")}),
            "mm_hashes": {"image": hashes},
            "mm_placeholders": {"image": image_fields(last, "mm_placeholders") + moved}}


class RowRequests:
    """The engine inputs of one rollout's rows, each from the row's last one where it can."""

    def __init__(self, llm: Any, prompt_of: Callable[[Stream], dict[str, Any]],
                 by_turn: bool = True) -> None:
        self.llm, self.prompt_of = llm, prompt_of
        self.cache = llm.renderer.mm_processor_cache
        kind = type(self.cache).__name__
        self.by_turn = by_turn and (self.cache is None or kind in (SENDER_CACHE, FRONT_END_CACHE))
        if by_turn and not self.by_turn:
            warn_fallback("rendering each turn's new tokens", f"vLLM's processor cache is {kind}, "
                          "whose items this engine does not reuse: each request is rendered whole")
        self.last: dict[int, tuple[Stream, dict[str, Any]]] = {}
        self.made = 0  # requests made
        self.whole = 0  # of them rendered whole (a row's first, or one that could not extend)

    def engine_input(self, row: int, stream: Stream) -> dict[str, Any]:
        """Row `row`'s request for `stream`, kept as the row's last."""
        last = self.last.get(row)
        items = None
        if self.by_turn and last is not None and grown_from(stream, last[0]):
            items = old_items(self.cache, last[1])
        if last is None or items is None:
            engine_input = render(self.llm, self.prompt_of(stream))
            self.whole += 1
        else:
            start, images = len(last[0].tokens_T), len(last[0].images)
            new = render(self.llm, self.prompt_of(tail(stream, start, images)))
            engine_input = extend_input(last[1], new, items)
        self.made += 1
        self.last[row] = (stream, engine_input)
        return engine_input
