"""Per-token policy losses, one function each, picked by name from `LOSSES`.

Every loss sees, for one datum, the trainer's log-probs `logp_T` (differentiable), the sampler's
`sampler_logp_T`, per-token advantages `adv_T` and weights `w_T` (the loss mask, 0 on
observation tokens), and returns the per-token loss `loss_T`; the caller sums it (Tinker's
convention) or applies a mean reduction. With r = exp(logp - sampler_logp):

    cross_entropy        -(w * logp)
    importance_sampling  -(w * r * A)
    ppo                  -(w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A))
    cispo                -(w * stopgrad(clip(r, cispo_min, cispo_max)) * logp * A)

With truncated importance sampling (`LossConfig.tis_cap`, `truncated_is`) r is taken against
the trainer's own log-probs and w carries min(trainer / sampler, cap) instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LossConfig:
    """Knobs of the policy losses (SkyRL's PPO defaults: clip 0.2 / 0.2; the reduction is the
    run's default, algorithm.loss_reduction)."""

    clip_low: float = 0.2  # PPO: ratio floor is 1 - clip_low
    clip_high: float = 0.2  # PPO: ratio ceiling is 1 + clip_high
    cispo_min: float = 0.0  # CISPO: ratio weights clipped to [cispo_min, cispo_max]
    cispo_max: float = 4.0
    reduction: str = "sequence_mean"  # "sum" | "token_mean" | "sequence_mean" (the run's default)
    temperature: float = 1.0  # trainer log-probs at the sampling temperature
    tis_cap: float = 0.0  # truncated importance sampling (`truncated_is`); 0 = off

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, "
                             f"got {self.reduction!r}")


def cross_entropy(logp_T, sampler_logp_T, adv_T, w_T, cfg: LossConfig) -> torch.Tensor:
    """Supervised: -(w * logp)."""
    return -(w_T * logp_T)


def importance_sampling(logp_T, sampler_logp_T, adv_T, w_T, cfg: LossConfig) -> torch.Tensor:
    """REINFORCE with an importance ratio: -(w * r * A)."""
    ratio_T = torch.exp(logp_T - sampler_logp_T)
    return -(w_T * ratio_T * adv_T)


def ppo(logp_T, sampler_logp_T, adv_T, w_T, cfg: LossConfig) -> torch.Tensor:
    """Clipped surrogate: -(w * min(r A, clip(r) A))."""
    ratio_T = torch.exp(logp_T - sampler_logp_T)
    clipped_T = torch.clamp(ratio_T, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return -(w_T * torch.minimum(ratio_T * adv_T, clipped_T * adv_T))


def cispo(logp_T, sampler_logp_T, adv_T, w_T, cfg: LossConfig) -> torch.Tensor:
    """Clipped IS-weight policy optimisation: -(w * sg(clip(r, min, max)) * logp * A)."""
    weight_T = torch.clamp(torch.exp(logp_T - sampler_logp_T), cfg.cispo_min,
                           cfg.cispo_max).detach()
    return -(w_T * weight_T * logp_T * adv_T)


LossFn = Callable[..., torch.Tensor]
LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
}


def truncated_is(logp_B_T: list[torch.Tensor], sampler_B_T: list[torch.Tensor],
                 w_B_T: list[torch.Tensor], cap: float
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Truncated importance sampling: the ratio's base becomes the trainer's own log-probs
    (detached: r = 1 in value, the gradient of log p), and each token's weight is multiplied by
    min(exp(trainer - sampler), cap) -> (base_B_T, weights_B_T) for the loss."""
    own_B_T = [lp.detach() for lp in logp_B_T]
    return own_B_T, [w * torch.clamp(torch.exp(own - s), max=cap)
                     for own, s, w in zip(own_B_T, sampler_B_T, w_B_T)]


def _sum(loss_B_T: list[torch.Tensor], w_B_T: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.sum() for x in loss_B_T]).sum()


def _token_mean(loss_B_T: list[torch.Tensor], w_B_T: list[torch.Tensor]) -> torch.Tensor:
    tokens = torch.stack([(w != 0).sum() for w in w_B_T]).sum()  # no read-back
    return _sum(loss_B_T, w_B_T) / tokens.clamp(min=1)


def _sequence_mean(loss_B_T: list[torch.Tensor], w_B_T: list[torch.Tensor]) -> torch.Tensor:
    per_seq = [x.sum() / (w != 0).sum().clamp(min=1) for x, w in zip(loss_B_T, w_B_T)]
    return torch.stack(per_seq).mean()


REDUCTIONS: dict[str, Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor]] = {
    "sum": _sum,
    "token_mean": _token_mean,
    "sequence_mean": _sequence_mean,
}


def _sum_scales(tokens_B: list[int]) -> list[float]:
    return [1.0] * len(tokens_B)


def _token_mean_scales(tokens_B: list[int]) -> list[float]:
    return [1.0 / max(sum(tokens_B), 1)] * len(tokens_B)


def _sequence_mean_scales(tokens_B: list[int]) -> list[float]:
    return [1.0 / (len(tokens_B) * max(n, 1)) for n in tokens_B]


REDUCTION_SCALES: dict[str, Callable[[list[int]], list[float]]] = {
    "sum": _sum_scales,
    "token_mean": _token_mean_scales,
    "sequence_mean": _sequence_mean_scales,
}
"""Each reduction as one weight per datum over the datums' weighted-token counts: the
"sum" reduction of the scaled weights equals REDUCTIONS[name] of the unscaled ones, over any
split of the batch (how `rl.phases.global_weights` keeps mini-batches exact)."""


def loss_metrics(logp_B_T, sampler_B_T, w_B_T, entropy_B_T, cfg: LossConfig) -> dict[str, float]:
    """KL(sampler || trainer) (k3 estimator), the share of tokens the loss's ratio clips (against
    the sampler; under truncated importance sampling against the trainer's own log-probs, so
    none in the one forward), entropy and token count; with cfg.tis_cap the share of tokens
    whose weight min(trainer / sampler, cap) was cut to the cap."""
    tokens = int(sum(int((w != 0).sum()) for w in w_B_T))
    return read_metrics(metric_tensors(logp_B_T, sampler_B_T, w_B_T, entropy_B_T, cfg, tokens))


def metric_tensors(logp_B_T, sampler_B_T, w_B_T, entropy_B_T, cfg: LossConfig, tokens: int
                   ) -> dict[str, Any]:
    """`loss_metrics` as 0-d tensors where the log-probs are, made without reading anything back
    from the device (`tokens`, the count of weighted tokens, comes from the caller): an update
    call can queue the next one's work before its metrics are read (`read_metrics`)."""
    tis: dict[str, Any] = {"tis_truncated_fraction": 0.0} if cfg.tis_cap else {}
    if tokens == 0:
        return {"kl_sampler_trainer": 0.0, "clip_fraction": 0.0, "entropy": 0.0,
                "tokens": 0} | tis
    with torch.no_grad():
        mask = torch.cat([w != 0 for w in w_B_T])
        log_ratio = torch.where(mask, torch.cat(logp_B_T) - torch.cat(sampler_B_T), 0.0)
        ratio = log_ratio.exp()  # trainer / sampler; 1 off the mask

        def share(selected: torch.Tensor) -> torch.Tensor:
            return (selected & mask).sum() / tokens

        if cfg.tis_cap:  # the loss's ratio is against the trainer itself: 1, nothing clips
            tis["tis_truncated_fraction"] = share(ratio > cfg.tis_cap)
            clip_fraction: Any = 0.0
        else:
            clip_fraction = share((ratio < 1.0 - cfg.clip_low) | (ratio > 1.0 + cfg.clip_high))
        return {
            "kl_sampler_trainer": (ratio - 1.0 - log_ratio).sum() / tokens,
            "clip_fraction": clip_fraction,
            "entropy": torch.where(mask, torch.cat(entropy_B_T), 0.0).sum() / tokens,
            "tokens": tokens,
        } | tis


def read_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """`metric_tensors` as Python numbers, read back from the device at once."""
    keys = [k for k, v in metrics.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([metrics[k].double() for k in keys]).tolist() if keys else []
    return metrics | dict(zip(keys, values))
