"""One update opened up: sampler vs trainer log-probabilities, ratios, per-module grad norms.

    fb = training_client.forward(datums, "ppo", loss_cfg).result()
    sampler_N, trainer_N = logprob_pairs(datums, fb.logprobs_B_T)
    ratio_stats(sampler_N, trainer_N, loss_cfg)       # ratio range, clip fraction, max |diff|
    module_grad_norms(training_client, datums, "ppo", loss_cfg)  # {"layers.0.self_attn.q_proj": ..}

Before any update the trainer recomputes the sampler's log-probabilities (to about 1e-6), so
every ratio is 1; after an update the ratios move and PPO clips those outside [1-eps, 1+eps].
"""

from __future__ import annotations

import re
from dataclasses import replace

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
