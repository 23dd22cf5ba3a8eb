"""Group-relative advantage estimators, one function each, picked by name from `ADVANTAGES`
(`algorithm.advantage`): rewards_P_G in, advantages_P_G out. `parity` is for benchmarks only."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def grpo_advantages(rewards_P_G: np.ndarray) -> np.ndarray:
    """(r - group mean) / (unbiased group std + 1e-6)."""
    mean_P1 = rewards_P_G.mean(axis=1, keepdims=True)
    std_P1 = rewards_P_G.std(axis=1, ddof=1, keepdims=True)
    return (rewards_P_G - mean_P1) / (std_P1 + 1e-6)


def dr_grpo_advantages(rewards_P_G: np.ndarray) -> np.ndarray:
    """r - group mean (no std normalisation: Dr. GRPO)."""
    return rewards_P_G - rewards_P_G.mean(axis=1, keepdims=True)


def rloo_advantages(rewards_P_G: np.ndarray) -> np.ndarray:
    """r - mean of the other G-1 rewards of the group (leave-one-out baseline)."""
    G = rewards_P_G.shape[1]
    others_P_G = (rewards_P_G.sum(axis=1, keepdims=True) - rewards_P_G) / (G - 1)
    return rewards_P_G - others_P_G


def parity_advantages(rewards_P_G: np.ndarray) -> np.ndarray:
    """For benchmarks only, never a training signal: -1, +1, -1, ... by the episode's index
    p * G + g, whatever the rewards. A random-weights model earns the same reward in every
    episode, so every group would carry no signal and no update would run; with these, every
    group of G >= 2 holds both signs and the update trains on every episode, the same work as
    with real signal (`algorithm.advantage=parity`, benchmarks/gpu.py)."""
    P, G = rewards_P_G.shape
    index_P_G = np.arange(P * G).reshape(P, G)
    return np.where(index_P_G % 2 == 1, 1.0, -1.0)


ADVANTAGES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "parity": parity_advantages,
}
