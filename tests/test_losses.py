"""The per-token policy losses, the reductions and the loss metrics, against hand arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.session.losses import (
    LOSSES,
    REDUCTIONS,
    LossConfig,
    cispo,
    cross_entropy,
    importance_sampling,
    loss_metrics,
    ppo,
    truncated_is,
)

# One datum of three tokens; the third is an observation token (weight 0).
LOGP = [-1.0, -0.5, -2.0]
SAMPLER = [-1.2, -0.5, -1.0]
ADV = [1.0, 1.0, -1.0]
W = [1.0, 1.0, 0.0]
CFG = LossConfig(clip_low=0.2, clip_high=0.2)  # PPO ratio in [0.8, 1.2]


def _t(values: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=grad)


def _loss(name: str, logp, sampler, adv, w, cfg: LossConfig = CFG) -> torch.Tensor:
    return LOSSES[name](_t(logp), _t(sampler), _t(adv), _t(w), cfg)


def test_registry_holds_one_function_per_loss() -> None:
    assert LOSSES == {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling,
                      "ppo": ppo, "cispo": cispo}
    assert sorted(REDUCTIONS) == ["sequence_mean", "sum", "token_mean"]


def test_cross_entropy_is_minus_weighted_logp() -> None:
    loss_T = _loss("cross_entropy", LOGP, SAMPLER, ADV, W)
    expected_T = [-(1 * -1.0), -(1 * -0.5), -(0 * -2.0)]  # [1.0, 0.5, 0.0]
    assert loss_T.tolist() == pytest.approx(expected_T, abs=1e-12)
    assert float(loss_T.sum()) == pytest.approx(1.5, abs=1e-12)


def test_cross_entropy_ignores_sampler_and_advantages() -> None:
    a = _loss("cross_entropy", LOGP, SAMPLER, ADV, W)
    b = _loss("cross_entropy", LOGP, [0.0, 0.0, 0.0], [5.0, -3.0, 2.0], W)
    assert torch.equal(a, b)


def test_importance_sampling_is_minus_ratio_times_advantage() -> None:
    loss_T = _loss("importance_sampling", LOGP, SAMPLER, ADV, W)
    r0 = math.exp(-1.0 - -1.2)  # e^0.2
    r1 = math.exp(-0.5 - -0.5)  # 1
    r2 = math.exp(-2.0 - -1.0)  # e^-1
    expected_T = [-(1 * r0 * 1), -(1 * r1 * 1), -(0 * r2 * -1)]
    assert loss_T.tolist() == pytest.approx(expected_T, abs=1e-12)
    assert float(loss_T.sum()) == pytest.approx(-(math.exp(0.2) + 1.0), abs=1e-12)


def test_importance_sampling_gradient_is_minus_w_r_a() -> None:
    logp = _t(LOGP, grad=True)
    importance_sampling(logp, _t(SAMPLER), _t(ADV), _t(W), CFG).sum().backward()
    r_T = [math.exp(lp - s) for lp, s in zip(LOGP, SAMPLER)]
    expected = [-w * r * a for w, r, a in zip(W, r_T, ADV)]
    assert logp.grad.tolist() == pytest.approx(expected, abs=1e-12)


def test_ppo_clip_binds_for_positive_advantage() -> None:
    # token 0: r = e^0.2 = 1.2214 > 1.2 with A = +1 -> min(r A, 1.2 A) = 1.2
    loss_T = _loss("ppo", LOGP, SAMPLER, ADV, W)
    r0 = math.exp(0.2)
    assert r0 > 1.2
    expected_T = [-(1 * min(r0 * 1, 1.2 * 1)), -(1 * min(1.0, 1.0)), 0.0]
    assert loss_T.tolist() == pytest.approx(expected_T, abs=1e-12)
    assert loss_T[0].item() == pytest.approx(-1.2, abs=1e-12)
    assert float(loss_T.sum()) == pytest.approx(-2.2, abs=1e-12)


def test_ppo_clip_binds_for_negative_advantage() -> None:
    # r = e^-0.5 = 0.6065 < 0.8 with A = -1: min(-0.6065, -0.8) = -0.8 -> loss +0.8
    loss_T = _loss("ppo", [-1.5], [-1.0], [-1.0], [1.0])
    r = math.exp(-0.5)
    assert r < 0.8
    assert loss_T.tolist() == pytest.approx([-min(r * -1, 0.8 * -1)], abs=1e-12)
    assert loss_T.item() == pytest.approx(0.8, abs=1e-12)


def test_ppo_does_not_clip_on_the_pessimistic_side() -> None:
    # r > 1.2 with A < 0 and r < 0.8 with A > 0: the unclipped term is the min, kept as is.
    loss_T = _loss("ppo", [-0.5, -1.5], [-1.0, -1.0], [-1.0, 1.0], [1.0, 1.0])
    r_hi, r_lo = math.exp(0.5), math.exp(-0.5)
    assert loss_T.tolist() == pytest.approx([r_hi, -r_lo], abs=1e-12)


def test_ppo_clip_bounds_follow_config() -> None:
    cfg = LossConfig(clip_low=0.1, clip_high=0.3)  # ratio in [0.9, 1.3]
    loss_T = _loss("ppo", [0.5, -0.5], [0.0, 0.0], [1.0, -1.0], [1.0, 1.0], cfg)
    assert loss_T.tolist() == pytest.approx([-1.3, 0.9], abs=1e-12)


def test_ppo_gradient_is_zero_where_clipped() -> None:
    logp = _t(LOGP, grad=True)
    ppo(logp, _t(SAMPLER), _t(ADV), _t(W), CFG).sum().backward()
    # token 0 clipped (constant 1.2 A), token 1 unclipped: d/dlogp -(r A) = -r A = -1
    assert logp.grad.tolist() == pytest.approx([0.0, -1.0, 0.0], abs=1e-12)


def test_cispo_value() -> None:
    loss_T = _loss("cispo", LOGP, SAMPLER, ADV, W)
    r0, r1 = math.exp(0.2), 1.0
    expected_T = [-(1 * r0 * -1.0 * 1), -(1 * r1 * -0.5 * 1), 0.0]  # [e^0.2, 0.5, 0]
    assert loss_T.tolist() == pytest.approx(expected_T, abs=1e-12)
    assert float(loss_T.sum()) == pytest.approx(math.exp(0.2) + 0.5, abs=1e-12)


def test_cispo_gradient_treats_ratio_weight_as_constant() -> None:
    # d loss / d logp = -w * clip(r, 0, 4) * A (no derivative through the ratio)
    logp_list = [-1.0, -0.5, -2.0, 1.0]
    sampler_list = [-1.2, -0.5, -1.0, -1.0]  # last: r = e^2 = 7.39 -> weight clipped to 4
    adv_list = [1.0, 1.0, -1.0, 2.0]
    w_list = [1.0, 1.0, 0.0, 1.0]
    logp = _t(logp_list, grad=True)
    loss_T = cispo(logp, _t(sampler_list), _t(adv_list), _t(w_list), CFG)
    loss_T.sum().backward()
    weights = [min(max(math.exp(lp - s), 0.0), 4.0) for lp, s in zip(logp_list, sampler_list)]
    assert weights[3] == 4.0
    expected_grad = [-w * c * a for w, c, a in zip(w_list, weights, adv_list)]
    assert logp.grad.tolist() == pytest.approx(expected_grad, abs=1e-12)
    assert loss_T[3].item() == pytest.approx(-(1 * 4.0 * 1.0 * 2.0), abs=1e-12)
    # Without the stop-gradient the slope would be -w A r (logp + 1): not what we got.
    r0 = math.exp(0.2)
    assert logp.grad[0].item() != pytest.approx(-1 * r0 * (-1.0 + 1.0))


def test_cispo_max_follows_config() -> None:
    loss_T = _loss("cispo", [1.0], [0.0], [1.0], [1.0], LossConfig(cispo_max=2.0))
    assert loss_T.item() == pytest.approx(-(2.0 * 1.0 * 1.0), abs=1e-12)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_zero_weight_tokens_contribute_nothing(name: str) -> None:
    loss_T = _loss(name, [-0.3, -4.0], [-0.1, -0.2], [2.0, 3.0], [0.0, 0.0])
    assert loss_T.abs().sum().item() == 0.0


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo"])
def test_on_policy_policy_losses_agree(name: str) -> None:
    # With logp == sampler (r = 1) IS and PPO give -w A; CISPO gives -w A logp.
    logp = [-0.7, -1.3]
    loss_T = _loss(name, logp, logp, [0.5, -2.0], [1.0, 1.0])
    expected = ([-0.5, 2.0] if name != "cispo" else [-(0.5 * -0.7), -(-2.0 * -1.3)])
    assert loss_T.tolist() == pytest.approx(expected, abs=1e-12)


# ----------------------------------------------------------------------------- reductions

# Two sequences of cross-entropy losses: 2 and 3 weighted tokens.
SEQ_LOGP = [[-1.0, -0.5, -2.0], [-0.25, -3.0, -1.0, -0.5]]
SEQ_W = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]


def _seq_losses() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    w_B_T = [_t(w) for w in SEQ_W]
    loss_B_T = [cross_entropy(_t(lp), _t(lp), _t(w), w_t, CFG)
                for lp, w, w_t in zip(SEQ_LOGP, SEQ_W, w_B_T)]
    return loss_B_T, w_B_T


def test_reduction_sum() -> None:
    loss_B_T, w_B_T = _seq_losses()
    expected = (1.0 + 0.5) + (0.25 + 3.0 + 1.0)  # 5.75
    assert REDUCTIONS["sum"](loss_B_T, w_B_T).item() == pytest.approx(expected, abs=1e-12)


def test_reduction_token_mean() -> None:
    loss_B_T, w_B_T = _seq_losses()
    expected = ((1.0 + 0.5) + (0.25 + 3.0 + 1.0)) / (2 + 3)  # 1.15
    assert REDUCTIONS["token_mean"](loss_B_T, w_B_T).item() == pytest.approx(expected, abs=1e-12)


def test_reduction_sequence_mean() -> None:
    loss_B_T, w_B_T = _seq_losses()
    expected = ((1.0 + 0.5) / 2 + (0.25 + 3.0 + 1.0) / 3) / 2  # 1.08333...
    got = REDUCTIONS["sequence_mean"](loss_B_T, w_B_T).item()
    assert got == pytest.approx(expected, abs=1e-12)


def test_reductions_of_an_all_masked_sequence_do_not_divide_by_zero() -> None:
    loss_B_T = [_t([0.0, 0.0]), _t([2.0])]
    w_B_T = [_t([0.0, 0.0]), _t([1.0])]
    assert REDUCTIONS["token_mean"](loss_B_T, w_B_T).item() == pytest.approx(2.0)
    assert REDUCTIONS["sequence_mean"](loss_B_T, w_B_T).item() == pytest.approx(1.0)


def test_loss_config_rejects_unknown_reduction() -> None:
    with pytest.raises(ValueError, match="reduction") as err:
        LossConfig(reduction="bad")
    for name in ("sum", "token_mean", "sequence_mean", "bad"):
        assert name in str(err.value)


def test_loss_config_defaults() -> None:
    from workbench.config import AlgorithmConfig

    cfg = LossConfig()
    assert (cfg.clip_low, cfg.clip_high, cfg.cispo_max, cfg.reduction, cfg.temperature) == (
        0.2, 0.2, 4.0, "sequence_mean", 1.0)
    assert cfg.reduction == AlgorithmConfig().loss_reduction  # what the training loop uses


# ----------------------------------------------------------------------------- metrics


def test_metrics_on_policy_have_zero_kl_and_no_clipping() -> None:
    logp_B_T = [_t([-1.0, -0.5, -2.0]), _t([-0.3])]
    w_B_T = [_t([1.0, 1.0, 0.0]), _t([1.0])]
    ent_B_T = [_t([0.5, 1.0, 9.0]), _t([2.0])]
    m = loss_metrics(logp_B_T, [x.clone() for x in logp_B_T], w_B_T, ent_B_T, CFG)
    assert m["kl_sampler_trainer"] == 0.0
    assert m["clip_fraction"] == 0.0
    assert m["tokens"] == 3
    assert m["entropy"] == pytest.approx((0.5 + 1.0 + 2.0) / 3)  # the masked 9.0 is left out


def test_metrics_k3_kl_and_clip_fraction_by_hand() -> None:
    m = loss_metrics([_t(LOGP)], [_t(SAMPLER)], [_t(W)], [_t([0.1, 0.2, 0.3])], CFG)
    # masked tokens 0, 1: log r = [0.2, 0.0]; k3 = r - 1 - log r
    k3 = [(math.exp(0.2) - 1 - 0.2), (1.0 - 1 - 0.0)]
    assert m["kl_sampler_trainer"] == pytest.approx(sum(k3) / 2, abs=1e-12)
    assert m["kl_sampler_trainer"] > 0.0
    assert m["clip_fraction"] == 0.5  # r0 = 1.2214 > 1.2; r1 = 1 inside
    assert m["tokens"] == 2
    assert m["entropy"] == pytest.approx(0.15)


def test_metrics_kl_positive_both_directions_and_clip_counts() -> None:
    logp = _t([0.0, 0.0, 0.0, 0.0])
    sampler = _t([-0.5, 0.5, 0.1, -0.1])  # r = e^.5 (clip), e^-.5 (clip), e^-.1, e^.1
    m = loss_metrics([logp], [sampler], [_t([1.0] * 4)], [_t([0.0] * 4)], CFG)
    log_r = [0.5, -0.5, -0.1, 0.1]
    expected = sum(math.exp(x) - 1 - x for x in log_r) / 4
    assert m["kl_sampler_trainer"] == pytest.approx(expected, abs=1e-12)
    assert m["clip_fraction"] == 0.5
    assert m["tokens"] == 4


def test_metrics_of_no_weighted_tokens_are_zero() -> None:
    m = loss_metrics([_t([-1.0])], [_t([-2.0])], [_t([0.0])], [_t([1.0])], CFG)
    assert m == {"kl_sampler_trainer": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "tokens": 0}


# ------------------------------------------------------------ truncated importance sampling


def test_truncated_is_takes_the_ratio_against_the_trainer_and_caps_the_weight() -> None:
    """truncated_is: the ratio's base is the trainer's own log-probs (PPO's ratio is 1, nothing
    clips), and each token's weight is min(exp(trainer - sampler), cap): here e^0.2, 1 and the
    cap 2 for e^1 (the observation token keeps weight 0). The PPO loss's gradient is then
    -(weight * A) per token."""
    logp = _t([-1.0, -0.5, 0.0, -2.0], grad=True)
    sampler, adv, w = _t([-1.2, -0.5, -1.0, -1.0]), _t([1.0, -1.0, 1.0, 1.0]), _t([1, 1, 1, 0.0])
    [base], [weight] = truncated_is([logp], [sampler], [w], 2.0)
    assert torch.equal(base, logp.detach()) and not base.requires_grad
    assert weight.tolist() == pytest.approx([math.exp(0.2), 1.0, 2.0, 0.0], abs=1e-12)
    ppo(logp, base, adv, weight, CFG).sum().backward()
    assert logp.grad.tolist() == pytest.approx([-math.exp(0.2), 1.0, -2.0, 0.0], abs=1e-12)


def test_truncated_is_metrics_count_the_capped_tokens_and_no_clipping() -> None:
    """With cfg.tis_cap the clip fraction is that of the loss's own ratio (1: none), the KL is
    still the sampler's, and tis_truncated_fraction counts the weighted tokens past the cap."""
    cfg = LossConfig(tis_cap=1.1)  # r = e^0.2 (capped), 1, e^-1
    m = loss_metrics([_t(LOGP)], [_t(SAMPLER)], [_t([1.0, 1.0, 1.0])], [_t([0.0] * 3)], cfg)
    plain = loss_metrics([_t(LOGP)], [_t(SAMPLER)], [_t([1.0, 1.0, 1.0])], [_t([0.0] * 3)], CFG)
    assert m["tis_truncated_fraction"] == pytest.approx(1 / 3)
    assert m["clip_fraction"] == 0.0 < plain["clip_fraction"]
    assert m["kl_sampler_trainer"] == plain["kl_sampler_trainer"] > 0
    assert "tis_truncated_fraction" not in plain
