"""Episodes: scripted policies (oracle, random), the batched model rollout, and evaluation."""

from __future__ import annotations

import pytest
import torch

from workbench.envs import MazeConfig, MazeEnv, eval_set, oracle_ceiling, shortest_path_lengths
from workbench.envs.tasks import oracle_policy, random_open_policy, random_policy
from workbench.policy import SamplingParams, chat_format, start_stream
from workbench.rl import Episode, EvalResult, format_table, play_model, play_scripted, summarize
from workbench.rl.evaluate import TABLE_HEADER
from workbench.rl.rollout import ObserveCache, observe, user_text

# ---------------------------------------------------------------- scripted policies


def _replay(ep: Episode, config: MazeConfig) -> Episode:
    """Step a fresh env through ep's replies; returns what it records."""
    env = MazeEnv(config)
    env.reset(options={"init_state": ep.init_state})
    again = Episode(init_state=ep.init_state, positions=[env.pos])
    reward, info = 0.0, {}
    for reply in ep.replies:
        assert not env.done
        _, reward, _, _, info = env.step(reply)
        again.replies.append(reply)
        again.feedback.append(info["feedback"])
        again.positions.append(env.pos)
    assert env.done
    again.reward, again.success = reward, info["success"]
    return again


@pytest.mark.parametrize("grammar", ["keyword", "tuple"])
def test_oracle_reaches_goal_in_shortest_path(grammar: str) -> None:
    config = MazeConfig(size=7, grammar=grammar)
    states = eval_set(7, 16)
    lengths = shortest_path_lengths(states)
    episodes_P_G = play_scripted(oracle_policy, config, states)
    assert [len(group) for group in episodes_P_G] == [1] * 16
    for group, state, length in zip(episodes_P_G, states, lengths):
        ep = group[0]
        assert ep.init_state == state
        assert ep.success and ep.reward == 1.0
        assert ep.turns == length
        assert ep.positions[0] == state.start and ep.positions[-1] == state.goal
        assert len(ep.positions) == ep.turns + 1
        assert all(a.kind == "move" for a in ep.actions)
        assert all(f == "Action executed successfully." for f in ep.feedback)
    result = summarize("oracle", "scripted", episodes_P_G, states, config)
    assert result.solved == result.ceiling == oracle_ceiling(states, 15, "reach_goal") == 16
    assert result.success_rate == 1.0
    assert result.mean_turns == sum(lengths) / 16


@pytest.mark.parametrize("max_turns", [8, 9])
def test_oracle_stop_on_goal_needs_one_more_turn(max_turns: int) -> None:
    config = MazeConfig(size=7, reward="stop_on_goal", max_turns=max_turns)
    states = eval_set(7, 16)
    episodes_P_G = play_scripted(oracle_policy, config, states)
    for group, length in zip(episodes_P_G, shortest_path_lengths(states)):
        ep = group[0]
        solvable = length + 1 <= max_turns
        assert ep.success == solvable
        assert ep.turns == min(length + 1, max_turns)
        if solvable:
            assert ep.replies[-1] == "stop" and ep.positions[-1] == ep.init_state.goal
    result = summarize("oracle", "scripted", episodes_P_G, states, config)
    assert result.solved == result.ceiling == oracle_ceiling(states, max_turns, "stop_on_goal")
    assert result.solved == (16 if max_turns == 9 else 0)  # every 7x7 eval path is 8 moves


def test_oracle_ceiling_on_mixed_set() -> None:
    """9x9 at 15 turns under the stop rule: paths of 12 are solved, paths of 16 are not."""
    config = MazeConfig(size=9, reward="stop_on_goal", max_turns=15)
    states = eval_set(9, 16)
    lengths = shortest_path_lengths(states)
    episodes_P_G = play_scripted(oracle_policy, config, states)
    assert [g[0].success for g in episodes_P_G] == [n + 1 <= 15 for n in lengths]
    assert [g[0].turns for g in episodes_P_G] == [min(n + 1, 15) for n in lengths]
    result = summarize("oracle", "scripted", episodes_P_G, states, config)
    assert result.solved == result.ceiling == 11


@pytest.mark.parametrize("policy", [random_policy, random_open_policy])
def test_random_policy_is_reproducible(policy) -> None:
    config = MazeConfig(size=7, max_turns=10)
    states = eval_set(7, 4)
    a = play_scripted(policy, config, states, n=3, seed=7)
    b = play_scripted(policy, config, states, n=3, seed=7)
    c = play_scripted(policy, config, states, n=3, seed=8)
    replies = [[ep.replies for ep in group] for group in a]
    assert replies == [[ep.replies for ep in group] for group in b]
    assert [[ep.positions for ep in g] for g in a] == [[ep.positions for ep in g] for g in b]
    assert replies != [[ep.replies for ep in group] for group in c]
    for group in a:
        assert len(group) == 3
        for ep in group:
            assert 1 <= ep.turns <= 10
            assert set(ep.replies) <= {"right", "up", "left", "down"}
            again = _replay(ep, config)
            assert (again.positions, again.feedback, again.success, again.reward) == (
                ep.positions, ep.feedback, ep.success, ep.reward)
            if policy is random_open_policy:  # never walks into a wall
                assert all(p != q for p, q in zip(ep.positions, ep.positions[1:]))


# ---------------------------------------------------------------- model rollout

MODEL_CONFIG = MazeConfig(size=5, max_turns=3)  # one image token per observation (resized)


def _reply_runs(stream) -> list[list[int]]:
    """The stream's trainable tokens, split into contiguous runs (one per reply)."""
    runs, current = [], []
    for tok, m in zip(stream.tokens_T, stream.loss_mask_T):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.fixture(scope="module")
def model_episodes(tiny) -> list[list[Episode]]:
    params = SamplingParams(max_tokens=4, temperature=1.0)
    return play_model(tiny, MODEL_CONFIG, eval_set(5, 2), n=2, params=params,
                      generator=torch.Generator().manual_seed(0))


def test_play_model_episode_records(tiny, model_episodes) -> None:
    fmt = chat_format(tiny.processor)
    tok = tiny.processor.tokenizer
    states = eval_set(5, 2)
    assert [len(group) for group in model_episodes] == [2, 2]
    for group, state in zip(model_episodes, states):
        for ep in group:
            assert ep.init_state == state
            assert 1 <= ep.turns <= 3
            assert len(ep.actions) == len(ep.feedback) == ep.turns
            assert len(ep.positions) == ep.turns + 1 and ep.positions[0] == state.start
            stream = ep.stream
            # an observation (image) before each turn, none after the last
            assert len(stream.images) == ep.turns
            assert stream.tokens_T.count(fmt.image_pad) == ep.turns
            assert stream.tokens_T.count(fmt.vision_start) == ep.turns
            assert stream.tokens_T.count(fmt.im_start) == 1 + 2 * ep.turns
            # the stream ends on a closed assistant turn
            assert stream.tokens_T[-1 - len(fmt.newline):] == [fmt.im_end, *fmt.newline]
            text = tok.decode(stream.tokens_T)
            for k in range(ep.turns):
                assert f"This is step {k + 1}. You are allowed to take {2 - k} more steps." in text
            # replay through the env gives the recorded trajectory
            again = _replay(ep, MODEL_CONFIG)
            assert (again.positions, again.feedback, again.success, again.reward) == (
                ep.positions, ep.feedback, ep.success, ep.reward)


def test_play_model_replies_match_stream(tiny, model_episodes) -> None:
    tok = tiny.processor.tokenizer
    for group in model_episodes:
        for ep in group:
            runs = _reply_runs(ep.stream)
            assert len(runs) == ep.turns
            assert all(1 <= len(run) <= 4 for run in runs)
            assert [tok.decode(run, skip_special_tokens=True) for run in runs] == ep.replies
            reply_logps = [lp for lp, m in zip(ep.stream.logprobs_T, ep.stream.loss_mask_T) if m]
            assert all(lp < 0.0 for lp in reply_logps)
            assert sum(map(len, runs)) == len(reply_logps)


def test_play_model_is_reproducible(tiny, model_episodes) -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0)
    again = play_model(tiny, MODEL_CONFIG, eval_set(5, 2), n=2, params=params,
                       generator=torch.Generator().manual_seed(0))
    assert [[ep.replies for ep in g] for g in again] == [
        [ep.replies for ep in g] for g in model_episodes]
    assert [[ep.stream.tokens_T for ep in g] for g in again] == [
        [ep.stream.tokens_T for ep in g] for g in model_episodes]


def test_observe_cache_gives_the_streams_built_without_it(tiny, model_episodes) -> None:
    # A rollout's cache holds each distinct image's pixels and each distinct text's tokens
    # once; the streams it builds are token for token those built without it.
    fmt = chat_format(tiny.processor)
    ep = model_episodes[0][0]
    env = MODEL_CONFIG.make_env()
    obs, info = env.reset(options={"init_state": ep.init_state})
    cache = ObserveCache()
    system = start_stream(tiny.processor, fmt, MODEL_CONFIG.rules())
    with_cache = observe(system, tiny.processor, fmt, obs, info, MODEL_CONFIG, cache)
    without = observe(system, tiny.processor, fmt, obs, info, MODEL_CONFIG)
    again = observe(system, tiny.processor, fmt, obs, info, MODEL_CONFIG, cache)
    assert with_cache.tokens_T == without.tokens_T == again.tokens_T
    assert with_cache.mm_types_T == without.mm_types_T
    assert torch.equal(with_cache.images[0].pixel_values, without.images[0].pixel_values)
    assert again.images[0] is with_cache.images[0]  # the same pixels, processed once
    assert len(cache.images) == 1
    assert set(cache.texts) == {"user\n", "assistant\n", user_text(obs, info, MODEL_CONFIG)}


def test_play_model_greedy_rows_agree(tiny) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0)
    episodes_P_G = play_model(tiny, MODEL_CONFIG, eval_set(5, 2), n=2, params=params)
    for group in episodes_P_G:
        assert group[0].replies == group[1].replies
        assert group[0].stream.tokens_T == group[1].stream.tokens_T


@pytest.mark.parametrize("window", [0, 2])
def test_every_datum_holds_exactly_what_the_sampler_saw(tiny, window: int) -> None:
    """With and without an image window (generator.history_images), each datum is the token ids
    the sampler was given and drew, turn by turn: the trainer's log-probs of the weighted
    (sampled) tokens equal the sampler's to 1e-4, a windowed datum holds at most `window`
    images and its last reply is that turn's sampled reply, and the windowed history differs
    from the full one (older images are cut)."""
    import numpy as np

    from workbench.policy.forward import token_logprobs
    from workbench.rl.phases import AdvantageRecord, RolloutRecord, make_datums

    fmt = chat_format(tiny.processor)
    config = MazeConfig(size=9, max_turns=6)
    params = SamplingParams(max_tokens=3, temperature=1.0)
    episodes_P_G = play_model(tiny, config, eval_set(9, 2), n=2, params=params,
                              generator=torch.Generator().manual_seed(1), history_images=window)
    record = RolloutRecord(episodes_P_G, params, 0, 0.0)
    adv = AdvantageRecord(np.ones((2, 2)), 0, "grpo")
    datums = make_datums(record, adv)
    flat = [ep for group in episodes_P_G for ep in group]
    cut = [ep.turns > window > 0 for ep in flat]  # prompts no longer prefixes of the stream
    assert len(datums) == sum(ep.turns if c else 1 for ep, c in zip(flat, cut)) and any(cut) == \
        bool(window)
    with torch.no_grad():
        logp_B_T, _ = token_logprobs(tiny.model, [d.stream for d in datums], 1.0, fmt.banned,
                                     tiny.processor.tokenizer.pad_token_id)
    for d, logp_T in zip(datums, logp_B_T):
        weighted = [t for t, w in enumerate(d.weights_T) if w]
        assert weighted and all(d.stream.loss_mask_T[t] for t in weighted)
        sampler = torch.tensor([d.stream.logprobs_T[t] for t in weighted])
        torch.testing.assert_close(logp_T[weighted], sampler, rtol=0, atol=1e-4)
    if window:
        turn_datums = iter(datums)
        for ep, c in zip(flat, cut):
            assert len(ep.turn_streams) == ep.turns
            if not c:
                next(turn_datums)
                continue
            for turn in range(ep.turns):
                d = next(turn_datums)
                assert len(d.stream.images) == min(window, turn + 1)
                reply = [tok for tok, w in zip(d.stream.tokens_T, d.weights_T) if w]
                assert reply == _reply_runs(ep.stream)[turn]
        assert any(len(ep.turn_streams[-1]) < len(ep.stream) for ep in flat)


# ---------------------------------------------------------------- evaluation


def test_eval_result_by_hand() -> None:
    result = EvalResult(policy="oracle", mode="scripted", n_mazes=3, episodes_per_maze=2,
                        successes_P=(2, 0, 1), mean_turns=4.25, mean_reward=0.5, ceiling=2)
    assert result.success_rate == 0.5  # 3 of 6 episodes
    assert result.solved == 1.5  # mazes solved per pass
    assert result.row() == "oracle           scripted     1.5/3     50.0%    2/3     4.25"
    other = EvalResult("random", "sampled", 3, 1, (0, 0, 1), 15.0, 1 / 3, 2)
    assert other.success_rate == pytest.approx(1 / 3) and other.solved == 1.0
    table = format_table([result, other])
    lines = table.split("\n")
    assert lines == [TABLE_HEADER, result.row(), other.row()]
    assert lines[0].split() == ["policy", "mode", "solved", "rate", "ceiling", "turns"]
    assert lines[2].startswith("random ")
    assert format_table([]) == TABLE_HEADER


def test_summarize_counts_by_hand() -> None:
    """summarize on episodes with known outcomes: 2 mazes x 2 episodes."""
    states = eval_set(5, 2)
    config = MazeConfig(size=5, max_turns=5)

    def ep(state, success: bool, turns: int, reward: float) -> Episode:
        return Episode(init_state=state, replies=["up"] * turns, success=success, reward=reward)

    episodes_P_G = [[ep(states[0], True, 4, 1.0), ep(states[0], False, 5, 0.0)],
                    [ep(states[1], True, 2, 1.0), ep(states[1], True, 3, 1.0)]]
    result = summarize("x", "sampled", episodes_P_G, states, config)
    assert (result.n_mazes, result.episodes_per_maze, result.successes_P) == (2, 2, (1, 2))
    assert result.solved == 1.5 and result.success_rate == 0.75
    assert result.mean_turns == 3.5 and result.mean_reward == 0.75
    assert result.ceiling == oracle_ceiling(states, 5, "reach_goal")
