"""The GRPO phases: scoring, group advantages, datums, the update driver and evaluation."""

from __future__ import annotations

import math
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from workbench.envs import InitState, MazeConfig, eval_set, oracle_ceiling, shortest_path_lengths
from workbench.envs.tasks import oracle_policy
from workbench.policy import ChatFormat, SamplingParams, Stream, chat_format
from workbench.rl import Episode, play_model, play_scripted
from workbench.rl.phases import (
    ADVANTAGES,
    REWARD_FNS,
    AdvantageRecord,
    Batch,
    RolloutRecord,
    UpdateSettings,
    advantages,
    evaluate,
    make_datums,
    rollout,
    score,
    update,
)
from workbench.rl.rollout import play_episodes
from workbench.rl.sft import scripted_stream
from workbench.session import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LossConfig,
    OptimStepOutput,
    datum_from_stream,
)

SMALL = MazeConfig(size=5, max_turns=3)  # one image token per observation (merge 7)


def _done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


# ------------------------------------------------------------------------- advantages

REWARDS_2x4 = np.array([[1.0, 0.0, 0.0, 1.0],
                        [0.5, 0.0, 0.0, 0.0]])


def test_grpo_by_hand() -> None:
    rec = advantages(REWARDS_2x4.copy(), "grpo")
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 1: mean 0.125, std 0.25
    std0 = math.sqrt((0.5**2 * 4) / 3)
    std1 = math.sqrt((0.375**2 + 3 * 0.125**2) / 3)
    assert std1 == pytest.approx(0.25)
    expected = [[0.5 / (std0 + 1e-6), -0.5 / (std0 + 1e-6), -0.5 / (std0 + 1e-6),
                 0.5 / (std0 + 1e-6)],
                [0.375 / (std1 + 1e-6), -0.125 / (std1 + 1e-6), -0.125 / (std1 + 1e-6),
                 -0.125 / (std1 + 1e-6)]]
    np.testing.assert_allclose(rec.advantages_P_G, expected, rtol=0, atol=1e-12)
    # the same through numpy
    r = REWARDS_2x4
    np_ref = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(rec.advantages_P_G, np_ref, rtol=0, atol=1e-12)
    assert rec.zero_variance_groups == 0 and rec.estimator == "grpo"
    np.testing.assert_allclose(rec.advantages_P_G.sum(axis=1), 0.0, atol=1e-12)


def test_dr_grpo_by_hand() -> None:
    rec = advantages(REWARDS_2x4.copy(), "dr_grpo")
    expected = [[0.5, -0.5, -0.5, 0.5], [0.375, -0.125, -0.125, -0.125]]
    np.testing.assert_allclose(rec.advantages_P_G, expected, rtol=0, atol=1e-12)
    assert rec.estimator == "dr_grpo"


def test_rloo_by_hand() -> None:
    rec = advantages(REWARDS_2x4.copy(), "rloo")
    # r_i - mean of the other three
    expected = [[1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3],
                [0.5 - 0.0, 0 - 0.5 / 3, 0 - 0.5 / 3, 0 - 0.5 / 3]]
    np.testing.assert_allclose(rec.advantages_P_G, expected, rtol=0, atol=1e-12)
    # RLOO is Dr. GRPO scaled by G / (G - 1)
    dr = advantages(REWARDS_2x4.copy(), "dr_grpo").advantages_P_G
    np.testing.assert_allclose(rec.advantages_P_G, dr * 4 / 3, rtol=0, atol=1e-12)


def test_parity_gives_every_group_both_signs_whatever_the_rewards() -> None:
    flat = np.zeros((2, 4))  # a random-weights model: every reward alike
    rec = advantages(flat, "parity")
    assert rec.advantages_P_G.tolist() == [[-1.0, 1.0, -1.0, 1.0], [-1.0, 1.0, -1.0, 1.0]]
    assert rec.zero_variance_groups == 0 and rec.estimator == "parity"
    odd = advantages(REWARDS_2x4[:, :3].copy(), "parity").advantages_P_G  # by index p * G + g
    assert odd.tolist() == [[-1.0, 1.0, -1.0], [1.0, -1.0, 1.0]]


@pytest.mark.parametrize("estimator", sorted(set(ADVANTAGES) - {"parity"}))
def test_zero_variance_groups_are_counted_and_exactly_zero(estimator: str) -> None:
    rewards = np.array([[0.1, 0.1, 0.1, 0.1],  # float mean is not exactly 0.1
                        [1.0, 0.0, 1.0, 1.0],
                        [0.7, 0.7, 0.7, 0.7],
                        [0.0, 0.0, 0.0, 0.0]])
    before = rewards.copy()
    rec = advantages(rewards, estimator)
    assert rec.zero_variance_groups == 3
    for p in (0, 2, 3):
        assert rec.advantages_P_G[p].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert np.all(rec.advantages_P_G[1] != 0.0)
    expected_row = ADVANTAGES[estimator](before[1:2])[0]
    assert rec.advantages_P_G[1].tolist() == expected_row.tolist()
    np.testing.assert_array_equal(rewards, before)  # input untouched


def test_unknown_estimator_raises() -> None:
    with pytest.raises(ValueError, match="ppo_gae") as err:
        advantages(REWARDS_2x4.copy(), "ppo_gae")
    for name in ADVANTAGES:
        assert name in str(err.value)


# ------------------------------------------------------------------------- scoring


def _state(seed: int = 0) -> InitState:
    return eval_set(5, seed + 1)[seed]


def _hand_record() -> RolloutRecord:
    def ep(reward: float, success: bool) -> Episode:
        return Episode(init_state=_state(), reward=reward, success=success)

    episodes = [[ep(1.0, True), ep(0.2, False), ep(0.0, False)],
                [ep(0.8, True), ep(0.8, True), ep(0.1, False)]]
    return RolloutRecord(episodes, SamplingParams(), seed=0, seconds=0.0)


def test_score_defaults_to_env_reward() -> None:
    sc = score(_hand_record())
    assert sc.rewards_P_G.shape == (2, 3)
    assert sc.rewards_P_G.tolist() == [[1.0, 0.2, 0.0], [0.8, 0.8, 0.1]]
    assert list(sc.parts) == ["env"]


def test_score_weights_reward_functions() -> None:
    sc = score(_hand_record(), {"env": 0.5, "success": 2.0})
    expected = [[0.5 * 1.0 + 2.0, 0.5 * 0.2, 0.0], [0.5 * 0.8 + 2.0, 0.5 * 0.8 + 2.0, 0.5 * 0.1]]
    np.testing.assert_allclose(sc.rewards_P_G, expected, rtol=0, atol=1e-12)
    assert sc.parts["success"].tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert sc.parts["env"].tolist() == [[1.0, 0.2, 0.0], [0.8, 0.8, 0.1]]
    assert set(REWARD_FNS) == {"env", "success"}


def test_score_unknown_reward_function_raises() -> None:
    with pytest.raises(KeyError):
        score(_hand_record(), {"nope": 1.0})


# ------------------------------------------------------------------------- datums


@pytest.fixture(scope="module")
def fmt(tiny) -> ChatFormat:
    return chat_format(tiny.processor)


@pytest.fixture(scope="module")
def streams(tiny, fmt) -> list[Stream]:
    """Four scripted episode streams on two mazes (oracle and random policies)."""
    states = eval_set(5, 2)
    return [scripted_stream(tiny.processor, fmt, SMALL, states[0], "oracle"),
            scripted_stream(tiny.processor, fmt, SMALL, states[0], "random", seed=1),
            scripted_stream(tiny.processor, fmt, SMALL, states[1], "oracle"),
            scripted_stream(tiny.processor, fmt, SMALL, states[1], "random", seed=2)]


def _stream_record(streams: list[Stream]) -> RolloutRecord:
    states = eval_set(5, 2)
    eps = [Episode(init_state=states[i // 2], stream=s) for i, s in enumerate(streams)]
    return RolloutRecord([eps[:2], eps[2:]], SamplingParams(max_tokens=2), seed=0, seconds=0.0)


def test_scripted_streams_have_reply_masks(tiny, fmt, streams) -> None:
    tok = tiny.processor.tokenizer
    for s in streams:
        assert len(s.loss_mask_T) == len(s.tokens_T) == len(s.logprobs_T)
        replies = [t for t, m in zip(s.tokens_T, s.loss_mask_T) if m]
        assert replies.count(fmt.im_end) == 3  # max_turns=3 replies, each closed
        assert 0 < sum(s.loss_mask_T) < len(s)
        assert all(lp == 0.0 for lp in s.logprobs_T)
        ends = [i for i, t in enumerate(replies) if t == fmt.im_end]
        runs = [replies[a + 1:b] for a, b in zip([-1, *ends], ends)]
        words = {tok.decode(run) for run in runs}
        assert words <= {"right", "up", "left", "down", "stop"}


def test_make_datums_places_advantage_on_reply_tokens(streams) -> None:
    record = _stream_record(streams)
    adv = advantages(np.array([[1.0, 0.0], [0.5, 0.5]]), "dr_grpo")  # second group flat
    assert adv.zero_variance_groups == 1
    datums = make_datums(record, adv)
    assert len(datums) == 2  # one per non-zero-advantage episode
    for datum, stream, a in zip(datums, streams[:2], [0.5, -0.5]):
        assert datum.stream is stream
        assert len(datum.advantages_T) == len(datum.weights_T) == len(stream)
        assert datum.weights_T == tuple(float(m) for m in stream.loss_mask_T)
        for adv_t, m in zip(datum.advantages_T, stream.loss_mask_T):
            assert adv_t == (a if m else 0.0)
        assert sum(datum.advantages_T) == pytest.approx(a * sum(stream.loss_mask_T))


def test_make_datums_keeps_every_episode_without_drop_zero(streams) -> None:
    record = _stream_record(streams)
    adv = AdvantageRecord(np.array([[0.0, 2.0], [0.0, 0.0]]), zero_variance_groups=1,
                          estimator="grpo")
    assert len(make_datums(record, adv)) == 1
    datums = make_datums(record, adv, drop_zero=False)
    assert len(datums) == 4
    assert all(d.stream is s for d, s in zip(datums, streams))  # maze-major, sample order
    for d, a in zip(datums, [0.0, 2.0, 0.0, 0.0]):
        assert set(d.advantages_T) == ({0.0, a} if a else {0.0})
        assert d.weights_T == tuple(float(m) for m in d.stream.loss_mask_T)


def _walk(positions: list[tuple[int, int]], reward: float) -> Episode:
    """An episode that stood on `positions` (start first) and ended with `reward`."""
    turns = len(positions) - 1
    return Episode(init_state=_state(), replies=["up"] * turns, positions=positions,
                   reward=reward, success=reward > 0)


def test_step_advantages_compare_turns_from_the_same_square() -> None:
    from workbench.rl.phases import step_advantages

    s, a, b, goal = (3, 1), (2, 1), (3, 2), (1, 1)
    group = [_walk([s, a, goal], 1.0),  # returns 0.9, 1.0
             _walk([s, s, a, goal], 1.0),  # bumped at s first: returns 0.81, 0.9, 1.0
             _walk([s, b, b], 0.0)]  # failed: returns 0, 0
    rewards = np.array([[1.0, 1.0, 0.0]])
    [[adv_a, adv_bump, adv_fail]] = step_advantages([group], rewards, "dr_grpo", gamma=0.9)
    # square s: 0.9 (ep 0), 0.81 and 0.9 (ep 1), 0.0 (ep 2); mean 0.6525. Square a: 1.0 twice
    # (equal: 0). Square b: one turn only (0).
    np.testing.assert_allclose(adv_a, [0.9 - 0.6525, 0.0])
    np.testing.assert_allclose(adv_bump, [0.81 - 0.6525, 0.9 - 0.6525, 0.0])
    np.testing.assert_allclose(adv_fail, [0.0 - 0.6525, 0.0])
    assert adv_bump[0] < adv_a[0]  # the bump scores below the move made from the same square


def test_turn_advantages_add_the_weighted_step_part(streams) -> None:
    s, goal = (3, 1), (1, 1)
    group = [_walk([s, goal], 1.0), _walk([s, s], 0.0)]
    rec = advantages(np.array([[1.0, 0.0]]), "dr_grpo", [group], step_weight=0.5, gamma=1.0)
    np.testing.assert_allclose(rec.advantages_P_G, [[0.5, -0.5]])
    np.testing.assert_allclose(rec.of_turns(0, 0, 1), [0.5 + 0.5 * 0.5])
    np.testing.assert_allclose(rec.of_turns(0, 1, 1), [-0.5 - 0.5 * 0.5])
    plain = advantages(np.array([[1.0, 0.0]]), "dr_grpo")
    assert plain.turn_advantages_P_G is None and list(plain.of_turns(0, 1, 3)) == [-0.5] * 3
    with pytest.raises(ValueError, match="episodes"):
        advantages(np.array([[1.0, 0.0]]), "grpo", step_weight=1.0)


def test_a_flat_group_keeps_its_step_signal() -> None:
    s, a, goal = (3, 1), (2, 1), (1, 1)
    group = [_walk([s, a, goal], 1.0), _walk([s, s, a, goal], 1.0)]  # both solved: flat
    rec = advantages(np.array([[1.0, 1.0]]), "grpo", [group], step_weight=1.0, gamma=0.9)
    assert rec.zero_variance_groups == 1 and not rec.advantages_P_G.any()
    assert rec.of_turns(0, 1, 3)[0] < 0 < rec.of_turns(0, 0, 2)[0]  # the bump is the worse turn


def test_turn_datum_gives_each_reply_its_advantage(streams) -> None:
    from workbench.rl.phases import replies, turn_datum

    stream = streams[0]
    assert replies(stream) == 3
    datum = turn_datum(stream, np.array([1.0, -2.0, 0.5]))
    runs, reply = [], -1
    for t, m in enumerate(stream.loss_mask_T):
        if m and (t == 0 or not stream.loss_mask_T[t - 1]):
            reply += 1
        runs.append(reply if m else None)
    expected = [(1.0, -2.0, 0.5)[r] if r is not None else 0.0 for r in runs]
    assert list(datum.advantages_T) == expected
    assert datum.weights_T == tuple(float(m) for m in stream.loss_mask_T)


def test_oracle_datum_trains_only_the_oracle_replies(tiny, fmt) -> None:
    """SFT with noise: the random detours stay in context with weight 0, the oracle's replies
    get weight 1 on every token, and no token carries an advantage."""
    from workbench.rl.sft import _play_scripted_stream, oracle_datum

    config, state = MazeConfig(size=7, max_turns=10), eval_set(7, 1)[0]
    stream, own = _play_scripted_stream(tiny.processor, fmt, config, state, "oracle", 0.5, 3)
    datum = oracle_datum(tiny.processor, fmt, config, state, noise=0.5, seed=3)
    assert datum.stream.tokens_T == stream.tokens_T and 0 < sum(own) < len(own)
    runs = stream.reply_index_T()
    assert max(runs) + 1 == len(own) and runs.count(-1) == len(stream) - sum(stream.loss_mask_T)
    assert datum.weights_T == tuple(1.0 if r >= 0 and own[r] else 0.0 for r in runs)
    assert set(datum.advantages_T) == {0.0}


def test_make_datums_from_model_rollout_keeps_sampler_logprobs(tiny) -> None:
    states = eval_set(5, 2)
    eps = play_model(tiny, SMALL, states, n=2, params=SamplingParams(max_tokens=2),
                     generator=torch.Generator().manual_seed(0))
    record = RolloutRecord(eps, SamplingParams(max_tokens=2), seed=0, seconds=0.0)
    adv = advantages(np.array([[1.0, 0.0], [0.0, 1.0]]), "grpo")
    datums = make_datums(record, adv)
    assert len(datums) == 4
    for d, ep, a in zip(datums, record.flat, adv.advantages_P_G.flatten()):
        assert d.stream is ep.stream
        mask = ep.stream.loss_mask_T
        assert all(lp < 0.0 for lp, m in zip(d.stream.logprobs_T, mask) if m)
        assert d.advantages_T == tuple(a * float(m) for m in mask)


def test_datum_validates_lengths(streams) -> None:
    s = streams[0]
    with pytest.raises(ValueError, match="length"):
        Datum(stream=s, advantages_T=(0.0,) * (len(s) - 1), weights_T=(1.0,) * len(s))
    d = datum_from_stream(s, 1.5)
    assert d.advantages_T == tuple(1.5 * m for m in s.loss_mask_T)


# ------------------------------------------------------------------------- rollout / update


class ScriptedSampler:
    """A stand-in sampling client: plays the oracle, records each rollout call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, SamplingParams, int]] = []

    def play(self, loop, config, states, n, params, seed) -> Future:
        assert loop is play_episodes  # the loop phases.rollout hands the session
        self.calls.append((n, params, seed))
        return _done(play_scripted(oracle_policy, config, states, n, seed))


def test_rollout_wraps_the_sampler() -> None:
    sampler = ScriptedSampler()
    params = SamplingParams(max_tokens=2, temperature=0.5)
    cfg = MazeConfig(size=5, max_turns=4)
    record = rollout(sampler, Batch(cfg, eval_set(5, 3), G=2, params=params, seed=11))
    assert sampler.calls == [(2, params, 11)]
    assert (record.params, record.seed) == (params, 11)
    assert [len(g) for g in record.episodes_P_G] == [2, 2, 2]
    assert record.flat == [ep for g in record.episodes_P_G for ep in g]
    assert len(record.flat) == 6
    assert record.seconds >= 0.0


class FakeTrainer:
    """A stand-in training client returning fixed outputs, recording the call order."""

    def __init__(self, outs: list[ForwardBackwardOutput]) -> None:
        self.outs, self.calls = list(outs), []

    def forward_backward(self, datums, loss_fn, cfg) -> Future:
        self.calls.append(("fb", len(datums), loss_fn, cfg))
        return _done(self.outs.pop(0))

    def optim_step(self, adam) -> Future:
        self.calls.append(("opt", adam))
        return _done(OptimStepOutput(step=1, grad_norm=0.25, learning_rate=adam.learning_rate))


def test_update_minibatches_then_steps_once(streams) -> None:
    out_a = ForwardBackwardOutput(1.0, {"kl_sampler_trainer": 0.2, "clip_fraction": 0.0,
                                        "entropy": 1.0, "tokens": 3})
    out_b = ForwardBackwardOutput(-0.5, {"kl_sampler_trainer": 0.6, "clip_fraction": 1.0,
                                         "entropy": 2.0, "tokens": 1})
    trainer = FakeTrainer([out_a, out_b])
    datums = [datum_from_stream(s, 1.0) for s in streams[:3]]
    cfg, adam = LossConfig(reduction="sum"), AdamParams(learning_rate=0.01)
    rec = update(trainer, datums, UpdateSettings("ppo", cfg, adam, minibatch=2))
    assert trainer.calls == [("fb", 2, "ppo", cfg), ("fb", 1, "ppo", cfg), ("opt", adam)]
    assert rec.datums == 3 and rec.grad_norm == 0.25 and rec.learning_rate == 0.01
    assert rec.metrics["loss"] == pytest.approx(0.5)
    assert rec.metrics["tokens"] == 4
    # token-weighted means over the mini-batches
    assert rec.metrics["kl_sampler_trainer"] == pytest.approx((0.2 * 3 + 0.6 * 1) / 4)
    assert rec.metrics["clip_fraction"] == pytest.approx(0.25)
    assert rec.metrics["entropy"] == pytest.approx((1.0 * 3 + 2.0) / 4)


def test_update_mini_batches_and_epochs_step_the_optimizer_each_time(streams) -> None:
    def out(loss: float) -> ForwardBackwardOutput:
        return ForwardBackwardOutput(loss, {"kl_sampler_trainer": 0.0, "clip_fraction": 0.5,
                                            "entropy": 1.0, "tokens": 2})

    trainer = FakeTrainer([out(1.0), out(3.0), out(5.0), out(7.0)])
    datums = [datum_from_stream(s, 1.0) for s in streams]
    cfg, adam = LossConfig(reduction="sequence_mean"), AdamParams(learning_rate=0.01)
    rec = update(trainer, datums, UpdateSettings("ppo", cfg, adam, minibatch=16, mini_batches=2,
                                                 epochs=2))
    summed = LossConfig(reduction="sum")
    assert trainer.calls == [("fb", 2, "ppo", summed), ("opt", adam)] * 4
    assert rec.metrics["loss"] == pytest.approx(4.0)  # the mean over the 4 optimizer steps
    assert rec.metrics["tokens"] == 4  # tokens of the batch (each epoch sees them once)


def test_mini_batches_take_their_own_sequence_mean(streams) -> None:
    from workbench.rl.phases import global_weights

    datums = [datum_from_stream(s, 1.0) for s in streams]
    trainer = FakeTrainer([ForwardBackwardOutput(0.0, {"kl_sampler_trainer": 0.0,
                                                       "clip_fraction": 0.0, "entropy": 0.0,
                                                       "tokens": 1})] * 2)
    sent = []
    trainer.forward_backward = lambda part, loss_fn, cfg: (sent.append(part), _done(
        trainer.outs.pop(0)))[1]
    update(trainer, datums, UpdateSettings("ppo", LossConfig(reduction="sequence_mean"),
                                           AdamParams(learning_rate=0.01), mini_batches=2))
    assert sent == [global_weights(datums[:2], "sequence_mean"),
                    global_weights(datums[2:], "sequence_mean")]
    for part in sent:  # each mini-batch's weights sum to 1: its own sequence mean
        assert sum(sum(d.weights_T) for d in part) == pytest.approx(1.0)


def test_update_without_datums_does_nothing() -> None:
    trainer = FakeTrainer([])
    with pytest.warns(RuntimeWarning, match="update skipped: 0 datums"):
        rec = update(trainer, [], UpdateSettings(adam=AdamParams(learning_rate=0.02)))
    assert trainer.calls == []
    assert (rec.metrics, rec.grad_norm, rec.learning_rate, rec.datums) == ({}, 0.0, 0.02, 0)


# ------------------------------------------------------------------------- evaluation


def test_evaluate_oracle_reaches_the_ceiling() -> None:
    cfg = MazeConfig(size=5, max_turns=4)  # every 5x5 path is 4 moves
    states = eval_set(5, 4)
    assert shortest_path_lengths(states) == [4, 4, 4, 4]
    sampler = ScriptedSampler()
    batch = Batch(cfg, states, G=2, params=SamplingParams(max_tokens=3, temperature=0.7), seed=9)
    ev = evaluate(sampler, batch, name="oracle", greedy=True)
    assert sampler.calls == [(1, SamplingParams(max_tokens=3, temperature=0.0), 9),
                             (2, SamplingParams(max_tokens=3, temperature=0.7), 9)]
    assert [r.mode for r in ev.results] == ["greedy", "sampled"]
    greedy, sampled = ev.by_mode("greedy"), ev.by_mode("sampled")
    assert greedy.policy == "oracle" and greedy.episodes_per_maze == 1
    assert sampled.episodes_per_maze == 2 and sampled.successes_P == (2, 2, 2, 2)
    assert greedy.solved == sampled.solved == greedy.ceiling == 4
    assert greedy.ceiling == oracle_ceiling(states, 4, "reach_goal")
    assert sampled.success_rate == 1.0 and sampled.mean_turns == 4.0
    assert [len(g) for g in ev.episodes["sampled"]] == [2, 2, 2, 2]


def test_evaluate_oracle_stop_rule_needs_one_more_turn() -> None:
    states, params = eval_set(5, 3), SamplingParams()
    four, five = (MazeConfig(size=5, max_turns=t, reward="stop_on_goal") for t in (4, 5))
    short = evaluate(ScriptedSampler(), Batch(four, states, G=0, params=params, seed=0))
    assert [r.mode for r in short.results] == ["greedy"]
    assert short.results[0].solved == short.results[0].ceiling == 0
    enough = evaluate(ScriptedSampler(), Batch(five, states, G=1, params=params, seed=0),
                      greedy=False)
    assert [r.mode for r in enough.results] == ["sampled"]
    assert enough.results[0].solved == enough.results[0].ceiling == 3
    assert enough.results[0].mean_turns == 5.0
