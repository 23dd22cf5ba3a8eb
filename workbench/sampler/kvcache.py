"""A KV cache that grows in place (capacity doubling) instead of concatenating every step.

transformers' DynamicLayer appends with `torch.cat`, copying the whole cache at every decoded
token; over a 15-turn episode that copy dominates CPU sampling. `GrowableLayer` keeps a buffer
with spare capacity and hands attention a view of the filled part: amortised O(1) per token.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class GrowableLayer(DynamicLayer):
    """DynamicLayer semantics over a preallocated buffer [B, H, capacity, D]."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._n = 0

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, need: int) -> None:
        if self._k is not None and need <= self._k.shape[-2]:
            return
        cap = max(2 * need, 256)
        B, H, _, _ = key_states.shape
        k = key_states.new_empty(B, H, cap, key_states.shape[-1])
        v = value_states.new_empty(B, H, cap, value_states.shape[-1])
        if self._n:
            assert self._k is not None and self._v is not None  # filled columns live in them
            k[..., : self._n, :] = self._k[..., : self._n, :]
            v[..., : self._n, :] = self._v[..., : self._n, :]
        self._k, self._v = k, v

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, add = self._n, key_states.shape[-2]
        self._reserve(key_states, value_states, n + add)
        assert self._k is not None and self._v is not None  # _reserve allocated them
        self._k[..., n : n + add, :] = key_states
        self._v[..., n : n + add, :] = value_states
        self._n = n + add
        self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:  # copies the filled part only; capacity is regrown on use
            assert self.keys is not None and self.values is not None
            self._k, self._v = self.keys[indices], self.values[indices]
            self.keys, self.values = self._k, self._v

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            assert self._k is not None
            self.batch_select_indices(
                torch.arange(self._k.shape[0], device=self._k.device).repeat_interleave(repeats)
            )


def growable_cache() -> Cache:
    """An empty cache whose layers grow in place."""
    return Cache(layer_class_to_replicate=GrowableLayer)


class PoolLayer(DynamicLayer):
    """DynamicLayer semantics over a fixed pool [rows, H, capacity, D] that outlives a batch.

    The rows in use are the pool's first `rows`; `batch_select_indices` compacts kept rows to the
    front in place, so the buffers keep their addresses (what a captured CUDA graph needs). A
    static step (`static` set: index tensor, window) writes one column at the index held in a
    device tensor and returns the first `window` columns; the mask hides the unfilled ones.
    The pool grows (new buffers, `generation` + 1) only if a batch outgrows it.
    """

    def __init__(self, rows: int = 0, capacity: int = 0) -> None:
        super().__init__()
        self.min_rows, self.min_capacity = rows, capacity
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._rows = 0  # rows in use
        self._n = 0  # filled columns
        self.generation = 0  # bumps whenever the buffers are reallocated
        self.static: tuple[torch.Tensor, int] | None = None  # (column index [1], window)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        self._view()

    def reset(self) -> None:
        """Empty the pool for a new batch (buffers kept)."""
        self._rows, self._n = 0, 0
        self._view()

    def _view(self) -> None:
        if self._k is None:
            self.keys = self.values = torch.empty(0)
        else:
            assert self._v is not None  # allocated with _k
            self.keys = self._k[: self._rows, :, : self._n, :]
            self.values = self._v[: self._rows, :, : self._n, :]

    def _reserve(self, like: torch.Tensor, rows: int, need: int) -> None:
        if self._k is not None and rows <= self._k.shape[0] and need <= self._k.shape[2]:
            return
        old_rows = 0 if self._k is None else self._k.shape[0]
        old_cap = 0 if self._k is None else self._k.shape[2]
        R = max(rows, self.min_rows, old_rows)
        C = max(need, self.min_capacity, old_cap if need <= old_cap else need + need // 4)
        _, H, _, D = like.shape
        # zeros, not empty: a step attends over a whole window, and a masked column still
        # multiplies its value by 0 - uninitialised memory can hold NaN (0 * NaN = NaN)
        k, v = like.new_zeros(R, H, C, D), like.new_zeros(R, H, C, D)
        if self._k is not None and self._n:
            assert self._v is not None  # allocated with _k
            k[: self._rows, :, : self._n] = self._k[: self._rows, :, : self._n]
            v[: self._rows, :, : self._n] = self._v[: self._rows, :, : self._n]
        self._k, self._v = k, v
        self.generation += 1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B, add = key_states.shape[0], key_states.shape[-2]
        if self.static is not None:  # one column at a device-held index (graph-capturable)
            index, window = self.static
            assert self._k is not None and self._v is not None  # a static step runs over the pool
            self._k[:B].index_copy_(2, index, key_states)
            self._v[:B].index_copy_(2, index, value_states)
            return self._k[:B, :, :window], self._v[:B, :, :window]
        n = self._n
        self._reserve(key_states, B, n + add)
        assert self._k is not None and self._v is not None  # _reserve allocated them
        self._k[:B, :, n : n + add] = key_states
        self._v[:B, :, n : n + add] = value_states
        self._rows, self._n = B, n + add
        self._view()
        assert self.keys is not None and self.values is not None  # _view set them
        return self.keys, self.values

    def advance(self, columns: int) -> None:
        """Account for `columns` written by static steps (graph replays run no Python)."""
        self._n += columns
        self._view()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        m = len(indices)
        if self._k is None or self._n == 0:
            self._rows = m
            return
        assert self._v is not None  # allocated with _k
        if m > self._k.shape[0]:
            self._reserve(self._k[:1], m, self._n)
        n = self._n
        self._k[:m, :, :n] = self._k[indices, :, :n]  # the right side is gathered first
        self._v[:m, :, :n] = self._v[indices, :, :n]
        self._rows = m
        self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(
            torch.arange(self._rows, device=self.device).repeat_interleave(repeats))


def pool_cache(layers: int, rows: int = 0, capacity: int = 0) -> Cache:
    """A cache of `layers` PoolLayers whose buffers start at rows x capacity (grown if needed)."""
    return Cache(layers=[PoolLayer(rows, capacity) for _ in range(layers)])
