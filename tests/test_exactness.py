"""Token exactness (every datum holds the ids the engine drew, turn by turn) and the context
budget (tokens per turn against the engine's limit; the one line a run that could pass it
prints before it starts)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMALL_RUN

from workbench.config import PRESETS, apply_overrides
from workbench.envs import MazeConfig, eval_set
from workbench.policy import SamplingParams, Stream
from workbench.policy.engine import EngineSettings
from workbench.rl import Episode, play_model
from workbench.rl.budget import context_limit, context_line, turn_budget, worst_case_tokens
from workbench.rl.phases import (
    AdvantageRecord,
    RolloutRecord,
    make_datums,
    reply_mismatches,
    token_mismatches,
)
from workbench.session.types import Datum, datum_from_stream

CONFIG = MazeConfig(size=5, max_turns=3)


@pytest.fixture(scope="module")
def record(tiny) -> RolloutRecord:
    """2 mazes x 2 episodes of the tiny default (random weights: replies of 4 odd tokens)."""
    params = SamplingParams(max_tokens=4, temperature=1.0)
    episodes_P_G = play_model(tiny, CONFIG, eval_set(5, 2), n=2, params=params,
                              generator=torch.Generator().manual_seed(0))
    return RolloutRecord(episodes_P_G, params, 0, 0.0)


ONES = AdvantageRecord(np.ones((2, 2)), 0, "grpo")


def _retokenized(stream: Stream, tokenizer) -> Stream:
    """The stream with each reply replaced by its decoded text encoded again (what a framework
    that re-tokenizes replies trains on)."""
    out, reply_T = Stream(), stream.reply_index_T()
    runs: dict[int, list[int]] = {}
    for tok, r in zip(stream.tokens_T, reply_T):
        if r >= 0:
            runs.setdefault(r, []).append(tok)
    t = 0
    while t < len(stream):
        r = reply_T[t]
        if r < 0:
            out = replace(out, tokens_T=out.tokens_T + [stream.tokens_T[t]],
                          mm_types_T=out.mm_types_T + [stream.mm_types_T[t]],
                          loss_mask_T=out.loss_mask_T + [0], logprobs_T=out.logprobs_T + [0.0])
            t += 1
            continue
        ids = tokenizer.encode(tokenizer.decode(runs[r], skip_special_tokens=True),
                               add_special_tokens=False)
        out = replace(out, tokens_T=out.tokens_T + ids, mm_types_T=out.mm_types_T + [0] * len(ids),
                      loss_mask_T=out.loss_mask_T + [1] * len(ids),
                      logprobs_T=out.logprobs_T + [0.0] * len(ids))
        t += len(runs[r])
    return replace(out, images=stream.images)


def test_datums_hold_the_sampled_ids(record: RolloutRecord) -> None:
    """A real rollout's datums count 0 mismatches; each episode recorded the engine's ids."""
    datums = make_datums(record, ONES)
    assert len(datums) == 4 and token_mismatches(record, ONES, datums) == 0
    ep = record.flat[1]
    assert ep.sampled_tokens == [[373, 475, 229, 255], [360, 397, 368, 104],
                                 [349, 124, 133, 325]]
    assert [tok for tok, m in zip(ep.stream.tokens_T, ep.stream.loss_mask_T) if m] == sum(
        ep.sampled_tokens, [])


def test_one_flipped_token_is_counted(record: RolloutRecord) -> None:
    datums = make_datums(record, ONES)
    d = datums[2]
    t = d.stream.loss_mask_T.index(1, 30)  # a reply token of the second turn
    tokens = list(d.stream.tokens_T)
    tokens[t] = tokens[t] + 1
    flipped = Datum(replace(d.stream, tokens_T=tokens), d.advantages_T, d.weights_T)
    assert token_mismatches(record, ONES, datums[:2] + [flipped] + datums[3:]) == 1


def test_a_retokenized_reply_is_counted(record: RolloutRecord, tiny) -> None:
    """Decoding a reply and encoding its text again gives other ids (the tiny tokenizer merges
    the sampled pieces differently): 3 tokens of turn 1 and 7 of turn 3 of this episode."""
    ep = record.flat[1]
    again = _retokenized(ep.stream, tiny.processor.tokenizer)
    assert again.tokens_T != ep.stream.tokens_T
    assert reply_mismatches(ep.sampled_tokens, again) == 10
    datums = make_datums(record, ONES)
    bad = datums[:1] + [datum_from_stream(again, 1.0)] + datums[2:]
    assert token_mismatches(record, ONES, bad) == 10
    with pytest.raises(ValueError, match="3 datums for the 4"):
        token_mismatches(record, ONES, datums[:3])


def test_windowed_datums_hold_the_sampled_ids(tiny) -> None:
    """With an image window each turn is a datum of its own prompt: still 0."""
    params = SamplingParams(max_tokens=3, temperature=1.0)
    episodes_P_G = play_model(tiny, MazeConfig(size=5, max_turns=4), eval_set(5, 1), n=2,
                              params=params, generator=torch.Generator().manual_seed(1),
                              history_images=1)
    ro = RolloutRecord(episodes_P_G, params, 0, 0.0)
    adv = AdvantageRecord(np.ones((1, 2)), 0, "grpo")
    datums = make_datums(ro, adv)
    assert len(datums) > 2 and token_mismatches(ro, adv, datums) == 0


def test_turn_budget_counts_each_turns_tokens(record: RolloutRecord) -> None:
    ep: Episode = record.flat[0]
    rows = turn_budget(ep, 4096)
    assert rows == [
        {"turn": 0, "image_tokens": 0, "text_tokens": 19, "reply_tokens": 0, "context": 19,
         "left": 4077},
        {"turn": 1, "image_tokens": 1, "text_tokens": 15, "reply_tokens": 4, "context": 39,
         "left": 4057},
        {"turn": 2, "image_tokens": 1, "text_tokens": 51, "reply_tokens": 4, "context": 95,
         "left": 4001},
        {"turn": 3, "image_tokens": 1, "text_tokens": 48, "reply_tokens": 4, "context": 148,
         "left": 3948},
    ]
    assert sum(r["image_tokens"] + r["text_tokens"] + r["reply_tokens"] for r in rows) == len(
        ep.stream) == rows[-1]["context"]


def test_context_limit_is_the_engines(tiny) -> None:
    config = tiny.model.config  # max_position_embeddings 4096
    assert context_limit(EngineSettings(), config) == 4096
    assert context_limit(EngineSettings(name="vllm"), config) == 4096
    assert context_limit(EngineSettings(name="vllm", max_model_len=300), config) == 300


def test_context_line_only_when_an_episode_could_pass_the_limit(tiny) -> None:
    default = PRESETS["tiny"]  # 15 turns, replies of up to 4 tokens
    assert worst_case_tokens(default, tiny.processor) == 739
    assert context_line(default, tiny.processor, tiny.model.config) is None
    small = apply_overrides(default, ["engine.name=vllm", "engine.max_model_len=300"])
    assert context_line(small, tiny.processor, tiny.model.config) == (
        "context: an episode can reach 739 tokens (15 turns, replies of up to 4 tokens), above "
        "the vllm engine's limit of 300: lower generator.max_turns or generator.max_tokens, or "
        "raise engine.max_model_len (vllm)")
    long = apply_overrides(default, ["generator.max_tokens=300"])
    line = context_line(long, tiny.processor, tiny.model.config)
    assert line is not None and line.startswith("context: an episode can reach 5179 tokens")


def test_a_step_logs_zero_mismatches_and_start_warns_once(sft_model: str,
                                                           tmp_path: Path) -> None:
    """train_step logs rollout/token_mismatches = 0 in metrics.jsonl; start says nothing of the
    context for the small run and one line for replies of 400 tokens (above tiny's 4096)."""
    from workbench.rl.train import start, train_step
    from workbench.run import read_metrics

    def config(folder: str, extra: list[str]):
        return apply_overrides(PRESETS["tiny"], SMALL_RUN + [
            f"model.name={sft_model}", f"run_dir={tmp_path / folder}", "trainer.total_steps=1",
            "trainer.ckpt_interval=0", "trainer.resume_mode=none", *extra])

    lines: list[str] = []
    trainer = start(config("small", []), log=lines.append)
    try:
        row = train_step(trainer)
    finally:
        trainer.session.close()
    assert not [x for x in lines if x.startswith("context:")]
    assert row["rollout/token_mismatches"] == 0
    assert read_metrics(trainer.run_dir)[-1]["rollout/token_mismatches"] == 0
    trainer = start(config("long", ["generator.max_tokens=400"]), log=lines.append)
    trainer.session.close()
    assert [x for x in lines if x.startswith("context:")] == [
        "context: an episode can reach 4449 tokens (10 turns, replies of up to 400 tokens), "
        "above the transformers engine's limit of 4096: lower generator.max_turns or "
        "generator.max_tokens, or raise engine.max_model_len (vllm)"]
