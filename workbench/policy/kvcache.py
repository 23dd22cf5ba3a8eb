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
        self._k[..., n : n + add, :] = key_states
        self._v[..., n : n + add, :] = value_states
        self._n = n + add
        self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:  # copies the filled part only; capacity is regrown on use
            self._k, self._v = self.keys[indices], self.values[indices]
            self.keys, self.values = self._k, self._v

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.batch_select_indices(
                torch.arange(self._k.shape[0], device=self._k.device).repeat_interleave(repeats)
            )


def growable_cache() -> Cache:
    """An empty cache whose layers grow in place."""
    return Cache(layer_class_to_replicate=GrowableLayer)
