"""One update opened up: sampler vs trainer log-probabilities, ratios, per-module grad norms.

    fb = training_client.forward(datums, "ppo", loss_cfg).result()
    sampler_N, trainer_N = logprob_pairs(datums, fb.logprobs_B_T)
    ratio_stats(sampler_N, trainer_N, loss_cfg)       # ratio range, clip fraction, max |diff|
    module_grad_norms(training_client, datums, "ppo", loss_cfg)  # {"layers.0.self_attn.q_proj": ..}
    table = token_table(datums, phases.datum_index(ro, adv, drop_zero=False), (0, 0),
                        before.logprobs_B_T, after.logprobs_B_T, loss_cfg, tokenizer)
    table.rows[0]   # turn, token, text, sampler, before, after, ratio_*, clipped_*, advantage

Before any update the trainer recomputes the sampler's log-probabilities (to about 1e-6), so
every ratio is 1; after an update the ratios move and PPO clips those outside [1-eps, 1+eps].
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from workbench.session.clients import TrainingClient
from workbench.session.losses import LossConfig
from workbench.session.types import Datum


def logprob_pairs(datums: list[Datum], trainer_B_T: list[list[float]]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Sampler and trainer log-prob of every weighted (reply) token, flattened: (N,), (N,)."""
    sampler, trainer = [], []
    for d, t_T in zip(datums, trainer_B_T):
        keep = [i for i, w in enumerate(d.weights_T) if w != 0]
        sampler += [d.stream.logprobs_T[i] for i in keep]
        trainer += [t_T[i] for i in keep]
    return np.asarray(sampler, dtype=np.float64), np.asarray(trainer, dtype=np.float64)


def ratio_stats(sampler_N: np.ndarray, trainer_N: np.ndarray, cfg: LossConfig) -> dict[str, float]:
    """Importance ratios r = exp(trainer - sampler): range, mean, PPO clip fraction, max |diff|."""
    ratio_N = np.exp(trainer_N - sampler_N)
    clipped_N = (ratio_N < 1.0 - cfg.clip_low) | (ratio_N > 1.0 + cfg.clip_high)
    return {"tokens": int(ratio_N.size), "ratio_min": float(ratio_N.min()),
            "ratio_max": float(ratio_N.max()), "ratio_mean": float(ratio_N.mean()),
            "clip_fraction": float(clipped_N.mean()),
            "max_abs_logprob_diff": float(np.abs(trainer_N - sampler_N).max())}


def module_name(param_name: str) -> str:
    """A parameter's module, short: "...layers.0.self_attn.q_proj.lora_A.default.weight" ->
    "layers.0.self_attn.q_proj"; vision parameters keep a "visual." prefix."""
    name = re.sub(r"\.(lora_[AB]|lora_embedding_[AB])\.[^.]+", "", param_name)
    name = name.removesuffix(".weight").removesuffix(".bias")
    for marker in ("language_model.", "visual."):
        if marker in name:
            short = name.split(marker, 1)[1]
            return short if marker == "language_model." else "visual." + short
    return name


def module_grad_norms(training_client: TrainingClient, datums: list[Datum], loss_fn: str,
                      cfg: LossConfig) -> dict[str, float]:
    """Gradient norm of each trainable module for the update `phases.update` would make (the
    batch-mean weights folded in), without stepping: gradients are dropped afterwards. On Ray
    the workers' slices are summed first, as the update sums them."""
    from workbench.rl.phases import global_weights

    weighted = global_weights(datums, cfg.reduction)
    squares = training_client.grad_squares(weighted, loss_fn,
                                           replace(cfg, reduction="sum")).result()
    by_module: dict[str, float] = {}
    for name, square in squares.items():
        key = module_name(name)
        by_module[key] = by_module.get(key, 0.0) + square
    return {k: v ** 0.5 for k, v in by_module.items()}


def ppo_clipped(ratio_N: np.ndarray, advantage_N: np.ndarray, cfg: LossConfig) -> np.ndarray:
    """Where PPO's min picks the clipped term (no gradient): a positive advantage with the ratio
    above 1 + clip_high, a negative one with it below 1 - clip_low. (N,) bool."""
    return ((advantage_N > 0) & (ratio_N > 1.0 + cfg.clip_high)) | \
        ((advantage_N < 0) & (ratio_N < 1.0 - cfg.clip_low))


@dataclass(frozen=True)
class TokenTable:
    """Every reply token of one episode, before and after an update: one row (a dict) each, in
    order: `turn` (1-based), `token` (id), `text`, `sampler`, `before`, `after` (log-probs),
    `ratio_before`, `ratio_after` (exp(trainer - sampler), unclipped), `clipped_before`,
    `clipped_after` (`ppo_clipped`) and `advantage`."""

    maze: int  # p of the episode
    sample: int  # g of the episode
    clip_low: float  # PPO's ratio floor is 1 - clip_low
    clip_high: float  # PPO's ratio ceiling is 1 + clip_high
    rows: list[dict[str, Any]]

    @property
    def turns(self) -> int:
        """Turns with at least one reply token."""
        return max((r["turn"] for r in self.rows), default=0)

    def of_turn(self, turn: int) -> list[dict[str, Any]]:
        """The rows of one turn (1-based)."""
        return [r for r in self.rows if r["turn"] == turn]

    def stats(self) -> dict[str, float]:
        """Tokens, the largest |ratio - 1| before and after, tokens clipped after."""
        before = np.array([r["ratio_before"] for r in self.rows])
        after = np.array([r["ratio_after"] for r in self.rows])
        return {"tokens": len(self.rows), "max_ratio_dev_before": float(np.abs(before - 1).max()),
                "max_ratio_dev_after": float(np.abs(after - 1).max()),
                "clipped_after": int(sum(r["clipped_after"] for r in self.rows))}

    def __repr__(self) -> str:
        s = self.stats()
        return (f"TokenTable(maze {self.maze}, sample {self.sample}: {s['tokens']} tokens over "
                f"{self.turns} turns, |ratio - 1| before {s['max_ratio_dev_before']:.2g}, after "
                f"{s['max_ratio_dev_after']:.2g}, {s['clipped_after']} clipped after)")


def token_table(datums: list[Datum], index: list[tuple[int, int]], episode: tuple[int, int],
                before_B_T: list[list[float]], after_B_T: list[list[float]], cfg: LossConfig,
                tokenizer: Any = None) -> TokenTable:
    """The weighted tokens of episode (p, g)'s datums (`index`: `phases.datum_index`, aligned
    with `datums`), with the trainer's log-probs of two forwards of those datums (before and
    after an update). A token's turn is its reply's index in the datum's stream, so windowed
    episodes (one datum per turn) read the same. `tokenizer` decodes each token's text."""
    rows: list[dict[str, Any]] = []
    for d, (p, g), before_T, after_T in zip(datums, index, before_B_T, after_B_T):
        if (p, g) != tuple(episode):
            continue
        reply_T = d.stream.reply_index_T()
        for t, w in enumerate(d.weights_T):
            if w == 0:
                continue
            token, sampler = d.stream.tokens_T[t], d.stream.logprobs_T[t]
            rows.append({"turn": reply_T[t] + 1, "token": token,
                         "text": tokenizer.decode([token]) if tokenizer is not None else "",
                         "sampler": sampler, "before": before_T[t], "after": after_T[t],
                         "ratio_before": float(np.exp(before_T[t] - sampler)),
                         "ratio_after": float(np.exp(after_T[t] - sampler)),
                         "advantage": d.advantages_T[t]})
    if not rows:
        raise ValueError(f"episode {tuple(episode)} has no datum (it was dropped: zero "
                         "advantage?); make the datums with drop_zero=False")
    adv_N = np.array([r["advantage"] for r in rows])
    for key in ("before", "after"):
        clipped_N = ppo_clipped(np.array([r[f"ratio_{key}"] for r in rows]), adv_N, cfg)
        for r, c in zip(rows, clipped_N):
            r[f"clipped_{key}"] = bool(c)
    return TokenTable(int(episode[0]), int(episode[1]), cfg.clip_low, cfg.clip_high, rows)
