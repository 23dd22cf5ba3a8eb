"""The policy: append-only streams, the batched KV-cached sampler, and the shared log-prob rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from workbench.envs import MazeConfig, MazeEnv, eval_set, system_prompt
from workbench.model import LoadedModel, LoraSettings, add_lora, load_model
from workbench.policy import (
    ChatFormat,
    SamplingParams,
    Stream,
    append_reply,
    append_user,
    chat_format,
    encode_image,
    masked_log_softmax,
    start_stream,
    token_logprobs,
)
from workbench.rl import play_model, user_text
from workbench.sampler.batch import decode, extend, open_batch, sample, select_rows

SMALL = MazeConfig(size=5, max_turns=4)  # one image token per observation (merge 7)


@pytest.fixture(scope="module")
def fmt(tiny) -> ChatFormat:
    return chat_format(tiny.processor)


@pytest.fixture(scope="module")
def pad_id(tiny) -> int:
    return tiny.processor.tokenizer.pad_token_id


def _first_stream(lm: LoadedModel, fmt: ChatFormat, seed: int, config: MazeConfig = SMALL,
                  system: str | None = None) -> tuple[Stream, MazeEnv]:
    env = MazeEnv(config)
    obs, info = env.reset(seed=seed)
    stream = start_stream(lm.processor, fmt, system if system is not None else
                          system_prompt(config))
    image = encode_image(lm.processor, obs["image"])
    return append_user(stream, lm.processor, fmt, user_text(obs, info, config), image), env


def _next_turn(lm: LoadedModel, fmt: ChatFormat, stream: Stream, env: MazeEnv,
               reply: str) -> Stream:
    obs, _, _, _, info = env.step(reply)
    image = encode_image(lm.processor, obs["image"])
    return append_user(stream, lm.processor, fmt, user_text(obs, info, env.config), image)


# ---------------------------------------------------------------- chat format and streams


def test_chat_format_ids(fmt: ChatFormat) -> None:
    assert (fmt.im_start, fmt.im_end, fmt.vision_start, fmt.vision_end, fmt.image_pad) == (
        1, 2, 9, 10, 12)
    assert len(fmt.newline) == 1
    # endoftext, im_start, vision start/end/pad, image_pad, video_pad
    assert fmt.banned == (0, 1, 9, 10, 11, 12, 13)
    assert fmt.im_end not in fmt.banned
    assert fmt.merge == 9


def test_stream_side_tables_and_masks(tiny, fmt: ChatFormat) -> None:
    tok = tiny.processor.tokenizer
    stream, env = _first_stream(tiny, fmt, seed=0)
    n_prompt = len(stream)
    up, stop = tok.encode("up", add_special_tokens=False), tok.encode("stop",
                                                                        add_special_tokens=False)
    # a reply that closed itself with <|im_end|>
    stream = append_reply(stream, fmt, [*up, fmt.im_end], [-0.5, -0.25])
    assert stream.tokens_T[n_prompt:] == [*up, fmt.im_end, *fmt.newline]
    n_first = len(stream)
    stream = _next_turn(tiny, fmt, stream, env, "up")
    n_second_prompt = len(stream)
    # a reply cut by length: a masked <|im_end|> then the newline are appended
    stream = append_reply(stream, fmt, [*stop, *up], [-1.0, -2.0])
    assert stream.tokens_T[n_second_prompt:] == [*stop, *up, fmt.im_end, *fmt.newline]

    T = len(stream)
    assert len(stream.mm_types_T) == len(stream.loss_mask_T) == len(stream.logprobs_T) == T
    reply_at = [n_prompt, n_prompt + 1, n_second_prompt, n_second_prompt + 1]
    assert [t for t in range(T) if stream.loss_mask_T[t] == 1] == reply_at
    assert [stream.logprobs_T[t] for t in reply_at] == [-0.5, -0.25, -1.0, -2.0]
    assert all(stream.logprobs_T[t] == 0.0 for t in range(T) if t not in reply_at)
    assert stream.loss_mask_T[n_second_prompt + 2] == 0  # the added <|im_end|>
    image_at = [t for t in range(T) if stream.tokens_T[t] == fmt.image_pad]
    assert [t for t in range(T) if stream.mm_types_T[t] == 1] == image_at
    assert len(image_at) == 2 * 1 and len(stream.images) == 2
    assert stream.tokens_T.count(fmt.vision_start) == stream.tokens_T.count(fmt.vision_end) == 2
    assert n_first < n_second_prompt


def test_append_is_pure(tiny, fmt: ChatFormat) -> None:
    """Appending returns a new stream; the old one (shared by G rows) is unchanged."""
    stream, _ = _first_stream(tiny, fmt, seed=0)
    snapshot = (list(stream.tokens_T), list(stream.loss_mask_T), len(stream.images))
    append_reply(stream, fmt, [fmt.im_end], [-1.0])
    append_user(stream, tiny.processor, fmt, "hi")
    assert (stream.tokens_T, stream.loss_mask_T, len(stream.images)) == (
        snapshot[0], snapshot[1], snapshot[2])


# ---------------------------------------------------------------- masked_log_softmax


def test_masked_log_softmax_hand_example() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    logp = masked_log_softmax(logits, 2.0, (1,))
    z = math.log(math.exp(0.5) + math.exp(1.5) + math.exp(2.0))
    expected = torch.tensor([[0.5 - z, -math.inf, 1.5 - z, 2.0 - z]])
    assert torch.isneginf(logp[0, 1])
    assert torch.allclose(logp, expected, atol=1e-6)
    # temperature 0 (greedy) reports log-probs at temperature 1
    z1 = math.log(math.exp(1.0) + math.exp(3.0) + math.exp(4.0))
    assert torch.allclose(masked_log_softmax(logits, 0.0, (1,)),
                          torch.tensor([[1.0 - z1, -math.inf, 3.0 - z1, 4.0 - z1]]), atol=1e-6)
    # no banned ids: a plain log-softmax
    assert torch.allclose(masked_log_softmax(logits, 1.0, ()), torch.log_softmax(logits, -1))


def test_masked_log_softmax_banned_and_normalised() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    banned = (0, 7, 49)
    for temperature in (0.5, 1.0, 1.7):
        logp = masked_log_softmax(logits, temperature, banned)
        assert torch.isneginf(logp[:, list(banned)]).all()
        assert torch.isfinite(logp[:, [i for i in range(50) if i not in banned]]).all()
        assert torch.allclose(logp.exp().sum(-1), torch.ones(3), atol=1e-6)


# ---------------------------------------------------------------- sample()


def test_sample_shapes_and_stop_reasons(tiny, fmt: ChatFormat, pad_id: int) -> None:
    streams = [_first_stream(tiny, fmt, seed)[0] for seed in (0, 1)]
    params = SamplingParams(max_tokens=5, temperature=1.0)
    out = sample(tiny.model, fmt, streams, 3, params, torch.Generator().manual_seed(0), pad_id)
    assert len(out) == 2 and all(len(group) == 3 for group in out)
    for group in out:
        for c in group:
            assert 1 <= len(c.tokens) == len(c.logprobs) <= 5
            assert all(lp <= 0.0 and math.isfinite(lp) for lp in c.logprobs)
            assert fmt.im_end not in c.tokens[:-1]
            assert (c.stop_reason == "stop") == (c.tokens[-1] == fmt.im_end)
            assert c.stop_reason in ("stop", "length")
            if c.stop_reason == "length":
                assert len(c.tokens) == 5


def test_sample_never_draws_banned_tokens(tiny, fmt: ChatFormat, pad_id: int) -> None:
    stream, _ = _first_stream(tiny, fmt, seed=0)
    params = SamplingParams(max_tokens=8, temperature=1.5)
    out = sample(tiny.model, fmt, [stream], 64, params, torch.Generator().manual_seed(0), pad_id)
    drawn = [t for c in out[0] for t in c.tokens]
    assert len(drawn) >= 64
    assert not set(drawn) & set(fmt.banned)
    # the ban is what keeps them out: unbanned, the random model gives them real mass
    live = open_batch()
    with torch.no_grad():
        extend(tiny.model, live, [stream], pad_id)
    p_banned = torch.softmax(live.logits_BV / 1.5, -1)[0, list(fmt.banned)].sum().item()
    assert p_banned > 0.005


def test_greedy_is_deterministic(tiny, fmt: ChatFormat, pad_id: int) -> None:
    streams = [_first_stream(tiny, fmt, seed)[0] for seed in (0, 2)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    a = sample(tiny.model, fmt, streams, 3, params, None, pad_id)
    b = sample(tiny.model, fmt, streams, 3, params, torch.Generator().manual_seed(9), pad_id)
    for group_a, group_b in zip(a, b):
        assert all(c.tokens == group_a[0].tokens for c in group_a + group_b)
        for c in group_a:  # identical rows, equal up to batched float rounding
            assert c.logprobs == pytest.approx(group_a[0].logprobs, abs=1e-5)
    # greedy takes the argmax of the first-step logits, reported at temperature 1
    live = open_batch()
    with torch.no_grad():
        extend(tiny.model, live, streams, pad_id)
    logp = masked_log_softmax(live.logits_BV, 1.0, fmt.banned)
    for p in range(2):
        assert a[p][0].tokens[0] == int(logp[p].argmax())
        assert a[p][0].logprobs[0] == pytest.approx(float(logp[p].max()), abs=1e-6)


def test_seeded_generator_reproduces(tiny, fmt: ChatFormat, pad_id: int) -> None:
    stream, _ = _first_stream(tiny, fmt, seed=1)
    params = SamplingParams(max_tokens=6, temperature=1.0)

    def draw(seed: int) -> list[list[int]]:
        out = sample(tiny.model, fmt, [stream], 4, params, torch.Generator().manual_seed(seed),
                     pad_id)
        return [c.tokens for c in out[0]]

    first = draw(123)
    assert draw(123) == first
    assert draw(124) != first
    assert len({tuple(t) for t in first}) > 1  # rows of one prompt draw independently


# ---------------------------------------------------------------- sampler / trainer agreement


@pytest.fixture(scope="module")
def lora_lm(tiny, tiny_dir: Path) -> LoadedModel:
    """A fresh tiny base wrapped in rank-8 LoRA with lora_B perturbed (the adapter is active)."""
    lm = load_model(str(tiny_dir))
    model = add_lora(lm.model, LoraSettings(rank=8, alpha=16))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05 * torch.randn_like(param))
    return LoadedModel(model=model.eval(), processor=tiny.processor, source="tiny+lora",
                       path=lm.path)


def _assert_agreement(lm: LoadedModel, temperature: float, seed: int,
                      max_tokens: int = 3) -> list[Stream]:
    """play_model's recorded log-probs == token_logprobs over the final streams (1e-4)."""
    fmt = chat_format(lm.processor)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    episodes_P_G = play_model(lm, SMALL, eval_set(5, 2), n=3, params=params,
                              generator=torch.Generator().manual_seed(seed))
    streams = [ep.stream for group in episodes_P_G for ep in group]
    assert len(streams) == 6
    assert max(ep.turns for group in episodes_P_G for ep in group) >= 2  # multi-turn
    with torch.no_grad():
        logps, entropies = token_logprobs(lm.model, streams, temperature, fmt.banned,
                                          lm.processor.tokenizer.pad_token_id)
    worst = 0.0
    for stream, logp, ent in zip(streams, logps, entropies):
        assert logp.shape == ent.shape == (len(stream),)
        mask = torch.tensor(stream.loss_mask_T, dtype=torch.bool)
        assert int(mask.sum()) >= 2
        sampled = torch.tensor(stream.logprobs_T)
        worst = max(worst, (logp[mask] - sampled[mask]).abs().max().item())
        assert torch.isfinite(logp[mask]).all() and bool((ent >= -1e-6).all())
    assert worst < 1e-4, worst
    return streams


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_and_trainer_logprobs_agree(tiny, temperature: float) -> None:
    _assert_agreement(tiny, temperature, seed=11)


def test_lora_adapter_is_active(tiny, lora_lm: LoadedModel, fmt, pad_id) -> None:
    stream, _ = _first_stream(tiny, fmt, seed=0)
    with torch.no_grad():
        base = token_logprobs(tiny.model, [stream], 1.0, fmt.banned, pad_id)[0][0]
        adapted = token_logprobs(lora_lm.model, [stream], 1.0, fmt.banned, pad_id)[0][0]
    finite = torch.isfinite(base)
    assert torch.equal(finite, torch.isfinite(adapted))  # -inf exactly on banned prompt tokens
    assert (base[finite] - adapted[finite]).abs().max().item() > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_and_trainer_logprobs_agree_with_lora(lora_lm: LoadedModel,
                                                      temperature: float) -> None:
    _assert_agreement(lora_lm, temperature, seed=5)


def test_agreement_with_rows_stopping_early(tiny_dir: Path) -> None:
    """With <|im_end|> made likely, rows finish at different steps: the batched cache then has
    holes (tokens fed after a row stopped), and log-probs must still agree."""
    lm = load_model(str(tiny_dir))
    fmt = chat_format(lm.processor)
    bias_V = torch.zeros(lm.model.config.text_config.vocab_size)
    bias_V[fmt.im_end] = 5.0
    lm.model.lm_head.register_forward_hook(lambda module, args, out: out + bias_V)
    streams = _assert_agreement(lm, 1.0, seed=2, max_tokens=4)
    runs = [run for s in streams for run in _reply_runs(s)]
    stopped_early = [r for r in runs if len(r) < 4 and r[-1] == fmt.im_end]
    full_length = [r for r in runs if len(r) == 4]
    assert stopped_early and full_length


def _reply_runs(stream: Stream) -> list[list[int]]:
    runs, current = [], []
    for tok, m in zip(stream.tokens_T, stream.loss_mask_T):
        if m:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_token_logprobs_is_padding_invariant(tiny, fmt: ChatFormat, pad_id: int) -> None:
    """A stream's log-probs do not depend on the other (longer) streams in its batch."""
    short, _ = _first_stream(tiny, fmt, seed=0)
    long, env = _first_stream(tiny, fmt, seed=1)
    long = _next_turn(tiny, fmt, append_reply(long, fmt, [fmt.im_end], [0.0]), env, "up")
    with torch.no_grad():
        alone = token_logprobs(tiny.model, [short], 1.0, fmt.banned, pad_id)[0][0]
        batched = token_logprobs(tiny.model, [long, short], 1.0, fmt.banned, pad_id)[0][1]
    assert alone.shape == batched.shape == (len(short),)
    assert alone[0] == 0.0
    assert torch.allclose(alone, batched, atol=1e-4)


def test_an_images_digest_is_its_rgb_source_where_it_has_one(tiny) -> None:
    """Two encodings of one RGB image are the same image; another image is not; an image
    without its RGB source is told by its pixels, and never equals one that has it."""
    from dataclasses import replace

    from workbench.policy.forward import image_digest

    obs0, _ = MazeEnv(MazeConfig(size=9)).reset(seed=0)
    obs1, _ = MazeEnv(MazeConfig(size=9)).reset(seed=1)
    a, b = (encode_image(tiny.processor, obs0["image"].copy()) for _ in range(2))
    other = encode_image(tiny.processor, obs1["image"])
    assert a is not b and image_digest(a) == image_digest(b) != image_digest(other)
    bare_a, bare_b = replace(a, image_HW3=None), replace(b, image_HW3=None)
    assert image_digest(bare_a) == image_digest(bare_b) != image_digest(a)
    assert image_digest(replace(other, image_HW3=None)) != image_digest(bare_a)


def every_occurrence(images: list) -> tuple[list, list[int]]:
    """`forward.distinct` as if no two images were equal: every occurrence encoded."""
    return images, list(range(len(images)))


def test_distinct_images_are_encoded_once_with_the_same_result(tiny_dir: Path, monkeypatch,
                                                              fmt: ChatFormat,
                                                              pad_id: int) -> None:
    """The update encodes each distinct image once and repeats its features: log-probs and
    gradients equal those of encoding every occurrence (the code before)."""
    import workbench.policy.forward as forward

    lm = load_model(tiny_dir)
    streams = []
    for reply in ("up", "left"):  # two episodes of maze 0: the same first image
        stream, env = _first_stream(lm, fmt, seed=0)
        stream = append_reply(stream, fmt, [fmt.im_end], [0.0])
        streams.append(_next_turn(lm, fmt, stream, env, reply))
    images = [img for s in streams for img in s.images]
    kept, index_N = forward.distinct(images)
    assert index_N[0] == index_N[2] == 0 and len(kept) < len(images)
    rows_R = forward.feature_rows(kept, index_N, forward.vision_merge(lm.model))
    assert len(rows_R) == sum(img.n_patches // forward.vision_merge(lm.model)**2 for img in images)

    def logprobs_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lm.model.zero_grad(set_to_none=True)
        logps, _ = token_logprobs(lm.model, streams, 1.0, fmt.banned, pad_id)
        torch.cat(logps).sum().backward()
        grads = {n: p.grad.clone() for n, p in lm.model.named_parameters() if p.grad is not None}
        return torch.cat(logps).detach(), grads

    once, grads_once = logprobs_and_grads()
    monkeypatch.setattr(forward, "distinct", every_occurrence)
    every, grads_every = logprobs_and_grads()
    assert torch.allclose(once, every, atol=1e-6)
    assert grads_once.keys() == grads_every.keys() and any("visual" in n for n in grads_once)
    for name, g in grads_once.items():  # equal up to float32 summation order
        assert (g - grads_every[name]).norm() <= 1e-5 * grads_every[name].norm() + 1e-9, name


def test_decoder_inputs_give_transformers_own_forward() -> None:
    """The trainer's decoder inputs (image features and DeepStack features put at their pads by
    index, the vision tower's tables made on the CPU) give the hidden states and gradients of
    transformers' own Qwen3-VL forward, on a shape with DeepStack: two episodes of one maze, so
    the same first image twice."""
    from workbench.model.presets import build_random
    from workbench.policy.forward import core_model, decoder_inputs, rope_positions, token_tables

    lm = build_random("qwen3-vl-small-shape", torch.float32, "cpu")
    core = core_model(lm.model)
    assert list(core.config.vision_config.deepstack_visual_indexes) == [1]
    lm_fmt = chat_format(lm.processor)
    streams = []
    for reply in ("up", "left"):
        stream, env = _first_stream(lm, lm_fmt, seed=0)
        stream = append_reply(stream, lm_fmt, [lm_fmt.im_end], [0.0])
        streams.append(_next_turn(lm, lm_fmt, stream, env, reply))
    ids_BL, mask_BL, types_BL, _ = token_tables(streams, 0, False)
    images = [img for s in streams for img in s.images]
    positions_3BL = rope_positions(lm.model, ids_BL, types_BL, images)

    def hidden_and_grads(ours: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lm.model.zero_grad(set_to_none=True)
        if ours:
            hidden = core.language_model(position_ids=positions_3BL, use_cache=False,
                                         **decoder_inputs(lm.model, ids_BL, images))
        else:
            hidden = core(input_ids=ids_BL, mm_token_type_ids=types_BL,
                          position_ids=positions_3BL, use_cache=False,
                          pixel_values=torch.cat([i.pixel_values for i in images]),
                          image_grid_thw=torch.stack([i.grid_thw for i in images]))
        hidden = hidden.last_hidden_state[mask_BL.bool()]
        (hidden * torch.linspace(-1, 1, hidden.shape[-1])).sum().backward()
        grads = {n: p.grad.clone() for n, p in core.named_parameters() if p.grad is not None}
        return hidden.detach(), grads

    ours, grads_ours = hidden_and_grads(True)
    theirs, grads_theirs = hidden_and_grads(False)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    assert grads_ours.keys() == grads_theirs.keys()
    assert any("deepstack_merger" in n for n in grads_ours)  # DeepStack's gradient flows
    for name, g in grads_ours.items():  # equal up to float32 summation order
        assert (g - grads_theirs[name]).norm() <= 1e-4 * grads_theirs[name].norm() + 1e-9, name


def test_deepstack_by_index_equals_transformers_by_mask() -> None:
    """`index_deepstack`: features added at flat pad indices give transformers' boolean-mask
    result exactly, forward and backward; a boolean mask still takes transformers' path."""
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextModel

    from workbench.policy.forward import index_deepstack

    text = SimpleNamespace()
    text._deepstack_process = lambda h, m, v: Qwen3VLTextModel._deepstack_process(None, h, m, v)
    index_deepstack(text)
    index_deepstack(text)  # once: the second call changes nothing
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 3, generator=g, requires_grad=True)
    mask_BL = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    visual = torch.randn(4, 3, generator=g, requires_grad=True)
    weight = torch.randn(2, 5, 3, generator=g)
    results = []
    for positions in (mask_BL, mask_BL.reshape(-1).nonzero().squeeze(1)):
        out = text._deepstack_process(hidden, positions, visual)
        hg, vg = torch.autograd.grad((out * weight).sum(), (hidden, visual))
        results.append((out, hg, vg))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- KV cache reuse


def test_kv_reuse_matches_fresh_prefill(tiny, fmt: ChatFormat, pad_id: int) -> None:
    """Turn-by-turn extend (with decode, rows of different lengths, a dropped row) gives the
    same next-token logits as one fresh prefill of the final streams."""
    tok = tiny.processor.tokenizer
    pairs = [_first_stream(tiny, fmt, seed) for seed in (0, 1, 2)]
    streams, envs = [s for s, _ in pairs], [e for _, e in pairs]
    # different system texts: rows differ in length from the first chunk on
    streams[1] = _first_stream(tiny, fmt, 1, system="Short rules.")[0]
    live = open_batch()
    extend(tiny.model, live, streams, pad_id)

    # turn 1: sampled replies (decode feeds them into the cache)
    params = SamplingParams(max_tokens=3, temperature=1.0)
    completions = decode(tiny.model, live, fmt, params, torch.Generator().manual_seed(3))
    replies = []
    for b, c in enumerate(completions):
        streams[b] = append_reply(streams[b], fmt, c.tokens, c.logprobs)
        replies.append(tok.decode(c.tokens, skip_special_tokens=True))
        streams[b] = _next_turn(tiny, fmt, streams[b], envs[b], replies[b])
    extend(tiny.model, live, streams, pad_id)

    # turn 2: hand replies of different lengths (fed by the next extend, not by decode)
    words = ["up", "left right down", "stop up left right down up"]  # longer reply, longer row
    order = sorted(range(3), key=lambda b: len(streams[b]))
    hand = [tok.encode(words[order.index(b)], add_special_tokens=False) for b in range(3)]
    hand[order[0]] = hand[order[0]] + [fmt.im_end]
    for b in range(3):
        streams[b] = append_reply(streams[b], fmt, hand[b], [0.0] * len(hand[b]))
        streams[b] = _next_turn(tiny, fmt, streams[b], envs[b], "down")
    assert len({len(s) for s in streams}) == 3
    extend(tiny.model, live, streams, pad_id)

    fresh = open_batch()
    extend(tiny.model, fresh, streams, pad_id)
    assert live.consumed_B == fresh.consumed_B == [len(s) for s in streams]
    assert live.images_B == fresh.images_B == [3, 3, 3]
    assert torch.equal(live.next_pos_B, fresh.next_pos_B)
    assert torch.allclose(live.logits_BV, fresh.logits_BV, atol=1e-4)

    # drop row 0, extend the others by one more turn
    select_rows(live, [1, 2])
    for b in (1, 2):
        streams[b] = append_reply(streams[b], fmt, hand[2], [0.0])
        streams[b] = _next_turn(tiny, fmt, streams[b], envs[b], "right")
    extend(tiny.model, live, streams[1:], pad_id)
    fresh = open_batch()
    extend(tiny.model, fresh, streams[1:], pad_id)
    assert torch.equal(live.next_pos_B, fresh.next_pos_B)
    assert torch.allclose(live.logits_BV, fresh.logits_BV, atol=1e-4)


def test_fresh_prefill_matches_full_forward(tiny, fmt: ChatFormat, pad_id: int) -> None:
    """extend's last-token logits over left-padded rows equal the trainer's right-padded pass."""
    from workbench.policy.forward import forward_logits, make_batch

    streams = [_first_stream(tiny, fmt, 0)[0], _first_stream(tiny, fmt, 1, system="Hi.")[0]]
    live = open_batch()
    extend(tiny.model, live, streams, pad_id)
    with torch.no_grad():
        for b, s in enumerate(streams):
            logits = forward_logits(tiny.model, make_batch(tiny.model, [s], pad_id, left=False),
                                    use_cache=False).logits
            assert torch.allclose(live.logits_BV[b], logits[0, -1], atol=1e-4)


def test_extend_builds_no_autograd_graph(tiny, fmt: ChatFormat, pad_id: int) -> None:
    stream, _ = _first_stream(tiny, fmt, seed=0)
    live = open_batch()
    extend(tiny.model, live, [stream], pad_id)  # called as play_model calls it: grad mode on
    assert not live.logits_BV.requires_grad
    assert not live.cache.layers[0].keys.requires_grad


# ---------------------------------------------------------------- shared prefix, image window


def _group_streams(tiny, fmt: ChatFormat) -> list[Stream]:
    """Three mazes x four noisy-oracle episodes: each maze's four share their first prompt."""
    from workbench.envs import MazeConfig, train_states
    from workbench.rl.sft import oracle_datum

    return [oracle_datum(tiny.processor, fmt, MazeConfig(size=9), s, 0.3, seed).stream
            for s in train_states(9, 0, 3) for seed in range(4)]


@pytest.mark.parametrize("keep", [False, True])
def test_shared_prefix_gives_the_same_logprobs_and_gradients(tiny, fmt: ChatFormat,
                                                              pad_id: int, keep: bool) -> None:
    """share_prefix runs each maze's first prompt once and continues its episodes from the
    cache: log-probs to 1e-5 and gradients to 1e-5 relative of the plain forward."""
    from workbench.policy.forward import image_digest, prefix_groups, token_logprobs, vision_merge

    streams = _group_streams(tiny, fmt)
    p, group_B = prefix_groups(streams, vision_merge(tiny.model))
    assert group_B == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8]
    # one maze's four share the first prompt: the same tokens and image; the next maze's
    # first prompt is the same text over another image
    assert p == streams[0].loss_mask_T.index(1) and streams[0].tokens_T[:p] == \
        streams[3].tokens_T[:p] == streams[4].tokens_T[:p]
    first = [image_digest(s.images[0]) for s in streams]
    assert first[0] == first[3] != first[4]
    keep_B_T = [[m == 1 for m in s.loss_mask_T] for s in streams] if keep else None
    results = []
    for share in (False, True):
        tiny.model.zero_grad()
        logp, ent = token_logprobs(tiny.model, streams, 1.0, fmt.banned, pad_id, keep_B_T, share)
        # prompt tokens may be banned for sampling (-inf): only the sampled ones count
        sampled = [torch.where(torch.tensor(s.loss_mask_T) == 1, lp, 0.0)
                   for s, lp in zip(streams, logp)]
        (sum(lp.sum() for lp in sampled) + 0.1 * sum(e.sum() for e in ent)).backward()
        results.append(([lp.detach() for lp in sampled],
                        {n: q.grad.clone() for n, q in tiny.model.named_parameters()
                         if q.grad is not None}))
    tiny.model.zero_grad()
    (plain, plain_grads), (shared, shared_grads) = results
    for a, b in zip(plain, shared):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert plain_grads.keys() == shared_grads.keys()
    for name, g in plain_grads.items():
        assert (shared_grads[name] - g).norm() <= 1e-5 * g.norm() + 1e-9, name


def test_keep_last_images_cuts_older_images_and_keeps_the_text(tiny, fmt: ChatFormat) -> None:
    from workbench.policy import keep_last_images

    stream = _group_streams(tiny, fmt)[0]
    n = len(stream.images)
    assert n > 3 and keep_last_images(stream, fmt, n) is stream
    cut = keep_last_images(stream, fmt, 2)
    assert cut.images == stream.images[-2:]
    assert cut.tokens_T.count(fmt.image_pad) == 2 == cut.tokens_T.count(fmt.vision_start)
    assert len(stream) - len(cut) == 3 * (n - 2)  # vision_start, image, vision_end
    text = [t for t in stream.tokens_T if t not in (fmt.vision_start, fmt.image_pad,
                                                    fmt.vision_end)]
    assert [t for t in cut.tokens_T if t not in (fmt.vision_start, fmt.image_pad,
                                                 fmt.vision_end)] == text
    assert cut.loss_mask_T.count(1) == stream.loss_mask_T.count(1)
