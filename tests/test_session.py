"""The in-process training session on the tiny model: futures in submission order, sampler and
trainer agreement, version pinning, LoRA-only updates, state round trips, atomic checkpoints,
PEFT export and full fine-tuning."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from workbench.envs import MazeConfig, MazeEnv, eval_set, system_prompt
from workbench.model import LoraSettings, TinySpec, build_tiny, load_model
from workbench.model.vision import batch_vision_attention, linear_patch_embed
from workbench.policy import SamplingParams, Stream, append_reply, chat_format, start_stream
from workbench.policy.forward import forward_logits, make_batch
from workbench.rl.rollout import observe, play_episodes
from workbench.rl.sft import scripted_stream
from workbench.session import (
    AdamParams,
    Datum,
    IncompleteCheckpoint,
    LossConfig,
    SampleResponse,
    Session,
    SessionSpec,
    checkpoint,
    create_session,
    create_session_from_state,
    datum_from_stream,
    is_complete,
)
from workbench.session.host import KEEP_VERSIONS

LORA = LoraSettings(rank=4, alpha=8)
SMALL = MazeConfig(size=5, max_turns=3)  # one image token per observation (merge 7)
ADAM = AdamParams(learning_rate=1e-2)
PARAMS = SamplingParams(max_tokens=2)


@pytest.fixture
def make_session(tiny_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Session]]:
    """create_session on the tiny folder (LoRA 4/8 by default); closed after the test."""
    made: list[Session] = []

    def make(name: str = "s", lora: LoraSettings | None = LORA,
             model: Path | None = None) -> Session:
        session = create_session(SessionSpec(str(model or tiny_dir), lora,
                                             workdir=str(tmp_path / name)))
        made.append(session)
        return session

    yield make
    for session in made:
        session.close()


@pytest.fixture(scope="module")
def oracle_datums(tiny) -> list[Datum]:
    """Cross-entropy datums of two scripted oracle episodes."""
    fmt = chat_format(tiny.processor)
    return [datum_from_stream(scripted_stream(tiny.processor, fmt, SMALL, state))
            for state in eval_set(5, 2)]


def _first_prompt(tiny) -> Stream:
    fmt = chat_format(tiny.processor)
    env = MazeEnv(SMALL)
    obs, info = env.reset(options={"init_state": eval_set(5, 1)[0]})
    system = start_stream(tiny.processor, fmt, system_prompt(SMALL))
    return observe(system, tiny.processor, fmt, obs, info, SMALL)


def _step(session: Session, datums: list[Datum], loss_fn: str = "cross_entropy") -> None:
    tc = session.training_client
    tc.forward_backward(datums, loss_fn)
    tc.optim_step(ADAM).result()


def _trainable(session: Session) -> dict[str, torch.Tensor]:
    return session.submit(lambda h: {n: p.detach().clone()
                                     for n, p in h.trainable().items()}).result()


def _state_dict(session: Session) -> dict[str, torch.Tensor]:
    return session.submit(lambda h: {n: t.detach().clone()
                                     for n, t in h.lm.model.state_dict().items()}).result()


def _masked_max_diff(stream: Stream, logprobs: list[float]) -> float:
    assert len(logprobs) == len(stream)
    return max(abs(a - b) for a, b, m in zip(stream.logprobs_T, logprobs, stream.loss_mask_T)
               if m)


@torch.no_grad()
def _logits(model, stream: Stream, pad_id: int) -> torch.Tensor:
    """Logits through the forward a host runs (its vision fast paths installed, as
    session.host.make_host does), so two models with equal weights give equal logits."""
    batch_vision_attention(model)
    linear_patch_embed(model)
    return forward_logits(model, make_batch(model, [stream], pad_id, left=False)).logits


def _rl_datums(episodes_P_G) -> list[Datum]:
    streams = [ep.stream for group in episodes_P_G for ep in group]
    return [datum_from_stream(s, 1.0 if i % 2 == 0 else -1.0) for i, s in enumerate(streams)]


# ------------------------------------------------------------------ futures and ordering


def test_queued_calls_run_in_submission_order(make_session, oracle_datums) -> None:
    session = make_session()
    tc = session.training_client
    before = tc.forward(oracle_datums).result().loss
    fb = tc.forward_backward(oracle_datums, "cross_entropy")
    opt = tc.optim_step(ADAM)
    fwd = tc.forward(oracle_datums)
    assert all(isinstance(f, Future) for f in (fb, opt, fwd))
    fresh = tc.forward(oracle_datums).result().loss
    assert fb.result().loss == before  # forward_backward saw the weights before the step
    assert opt.result().step == 1 and opt.result().learning_rate == ADAM.learning_rate
    assert fwd.result().loss == fresh  # the queued forward ran after the step
    assert fresh != before


def test_submit_order_is_execution_order(make_session, oracle_datums) -> None:
    session = make_session()
    tc = session.training_client
    order: list[tuple[str, int]] = []

    def mark(label: str) -> Future:
        return session.submit(lambda h: order.append((label, h.opt_steps)))

    futures = [mark("a"), tc.forward_backward(oracle_datums, "cross_entropy"), mark("b"),
               tc.optim_step(ADAM), mark("c"), tc.forward(oracle_datums), mark("d")]
    futures += [session.submit(lambda h, i=i: order.append((str(i), h.opt_steps)))
                for i in range(20)]
    for f in futures:
        f.result()
    assert order == [("a", 0), ("b", 0), ("c", 1), ("d", 1)] + [(str(i), 1) for i in range(20)]


def test_a_failed_call_raises_through_its_future_and_the_queue_goes_on(
        make_session, oracle_datums) -> None:
    session = make_session()
    tc = session.training_client
    bad = tc.forward(oracle_datums, "no_such_loss")
    good = tc.forward(oracle_datums)
    with pytest.raises(ValueError, match="no_such_loss"):
        bad.result()
    assert good.result().loss > 0.0


def test_pipelined_calls_give_what_the_host_gives_one_by_one(make_session,
                                                             oracle_datums) -> None:
    """forward_backward calls queued back to back on the lane (each launched before the one
    before it is read back) give the outputs and the summed gradients of `host.forward` called
    one at a time; a failing call among them fails alone, and a lone call resolves."""
    from workbench.session import host

    session = make_session()
    tc, h = session.training_client, session.host
    parts = [oracle_datums[:1], oracle_datums[1:], oracle_datums]
    cfg = LossConfig(reduction="sum")
    direct = [host.forward(h, part, "ppo", cfg, True) for part in parts]
    grads = {n: p.grad.clone() for n, p in h.trainable().items() if p.grad is not None}
    h.optimizer.zero_grad(set_to_none=True)
    futures = [tc.forward_backward(parts[0], "ppo", cfg), tc.forward_backward(parts[1], "bad"),
               tc.forward_backward(parts[1], "ppo", cfg), tc.forward_backward(parts[2], "ppo", cfg)]
    with pytest.raises(ValueError, match="bad"):
        futures[1].result()
    queued = [futures[0].result(), futures[2].result(), futures[3].result()]
    assert [(o.loss, o.metrics, o.logprobs_B_T) for o in queued] == \
        [(o.loss, o.metrics, o.logprobs_B_T) for o in direct]
    assert grads and all(torch.equal(p.grad, grads[n]) for n, p in h.trainable().items()
                         if n in grads)
    assert tc.forward(parts[0], "ppo", cfg).result().loss == direct[0].loss


def test_a_call_launched_as_the_session_closes_still_resolves(make_session,
                                                                oracle_datums) -> None:
    """The last forward call on a lane that takes no more work (the session closing) is read
    back at once instead of behind a read-back the lane would refuse."""
    session = make_session()
    session._pool.shutdown(wait=True)  # what close() starts with; its lane runs nothing new
    done: Future = Future()
    session._launch(done, oracle_datums, "cross_entropy", LossConfig(), False)
    assert done.done() and done.result().loss > 0.0


def test_forward_backward_loss_and_metrics(make_session, oracle_datums) -> None:
    session = make_session()
    tc = session.training_client
    out = tc.forward(oracle_datums, "cross_entropy", LossConfig(reduction="sum")).result()
    tokens = sum(sum(d.stream.loss_mask_T) for d in oracle_datums)
    # the sum reduction of -(w logp) is minus the summed trainer log-probs on reply tokens
    total = sum(lp for d, lps in zip(oracle_datums, out.logprobs_B_T)
                for lp, m in zip(lps, d.stream.loss_mask_T) if m)
    assert out.loss == pytest.approx(-total, rel=1e-5)
    assert out.metrics["tokens"] == tokens and out.metrics["loss"] == out.loss
    mean = tc.forward(oracle_datums, "cross_entropy",
                      LossConfig(reduction="token_mean")).result()
    assert mean.loss == pytest.approx(out.loss / tokens, rel=1e-5)


# ---------------------------------------------------------- sampler / trainer agreement


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_reproduces_sampler_logprobs(make_session, temperature: float) -> None:
    session = make_session()
    tc = session.training_client
    sampler = tc.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=2, temperature=temperature)
    episodes = sampler.play(play_episodes, SMALL, eval_set(5, 2), 2, params, seed=0).result()
    assert [len(g) for g in episodes] == [2, 2]
    streams = [ep.stream for group in episodes for ep in group]
    out = tc.forward([datum_from_stream(s) for s in streams], "importance_sampling",
                     LossConfig(temperature=temperature)).result()
    for stream, logprobs in zip(streams, out.logprobs_B_T):
        assert _masked_max_diff(stream, logprobs) < 1e-4
    assert out.metrics["kl_sampler_trainer"] < 1e-8
    assert out.metrics["clip_fraction"] == 0.0
    assert out.metrics["tokens"] == sum(sum(s.loss_mask_T) for s in streams)
    # the sampling client's own log-probs follow the same rule
    for stream in streams:
        assert _masked_max_diff(stream, sampler.compute_logprobs(stream, temperature).result()) \
            < 1e-4


def test_trainer_logprobs_do_not_depend_on_the_micro_batch_size(make_session) -> None:
    """The same 8 datums (episodes of different lengths, so a batch pads the shorter ones)
    forwarded in chunks of 1, 2 and 4 give the same per-token log-probs: within 1e-5 on the CPU
    in float32 (seen: up to 4.8e-7). Were padding to leak into real tokens, on-policy ratios
    would differ from 1 by the micro-batch size."""
    session = make_session()
    tc = session.training_client
    sampler = tc.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=2, temperature=1.0)
    streams = [[ep.stream for group in sampler.play(play_episodes, MazeConfig(5, max_turns=n),
                                                    eval_set(5, 2), 2, params, seed=0).result()
                for ep in group] for n in (2, 5)]  # turn budgets of 2 and 5: two lengths
    datums = [datum_from_stream(s) for pair in zip(*streams) for s in pair]  # interleaved
    assert len({len(d.stream) for d in datums}) > 1, "all of one length: nothing is padded"
    by_size = {}
    for size in (1, 2, 4):
        by_size[size] = [lp for k in range(0, len(datums), size)
                         for lp in tc.forward(datums[k:k + size], "ppo").result().logprobs_B_T]
    for size in (2, 4):
        for d, one_T, many_T in zip(datums, by_size[1], by_size[size]):
            kept = [t for t, w in enumerate(d.weights_T) if w]
            diff = max(abs(one_T[t] - many_T[t]) for t in kept)
            assert diff < 1e-5, f"chunks of {size} vs 1: |diff| {diff:.2e}"


def test_sampling_client_is_pinned_to_its_weights_version(make_session) -> None:
    session = make_session()
    tc = session.training_client
    old = tc.save_weights_and_get_sampling_client()
    episodes = old.play(play_episodes, SMALL, eval_set(5, 2), 2, PARAMS, seed=0).result()
    streams = [ep.stream for group in episodes for ep in group]
    datums = _rl_datums(episodes)
    _step(session, datums, "importance_sampling")
    trainer = tc.forward(datums, "importance_sampling").result()
    assert trainer.metrics["kl_sampler_trainer"] > 0.0  # the update moved the policy

    # the old client still samples and scores with the old weights
    for stream in streams:
        assert _masked_max_diff(stream, old.compute_logprobs(stream).result()) < 1e-4
    again = old.play(play_episodes, SMALL, eval_set(5, 2), 2, PARAMS, seed=0).result()
    assert [ep.stream.tokens_T for g in again for ep in g] == [s.tokens_T for s in streams]
    assert [ep.replies for g in again for ep in g] == [ep.replies for g in episodes for ep in g]

    # ... while the trainer gets its own weights back for the next call
    assert tc.forward(datums, "importance_sampling").result().loss == trainer.loss

    new = tc.save_weights_and_get_sampling_client()
    assert (old.version, new.version) == (0, 1)
    for stream, trainer_lp in zip(streams, trainer.logprobs_B_T):
        new_lp = new.compute_logprobs(stream).result()
        assert _masked_max_diff(stream, new_lp) > 1e-3
        assert max(abs(a - b) for a, b, m in zip(new_lp, trainer_lp, stream.loss_mask_T)
                   if m) < 1e-4


def test_old_sampler_versions_are_dropped(make_session, oracle_datums) -> None:
    session = make_session()
    tc = session.training_client
    stream = oracle_datums[0].stream
    clients = [tc.save_weights_and_get_sampling_client()]
    for _ in range(KEEP_VERSIONS + 2):
        _step(session, oracle_datums)
        clients.append(tc.save_weights_and_get_sampling_client())
    assert [c.version for c in clients] == list(range(KEEP_VERSIONS + 3))
    kept = sorted(session.host.versions)
    assert kept == [c.version for c in clients[-(KEEP_VERSIONS + 1):]]
    with pytest.raises(KeyError, match="dropped"):
        clients[0].compute_logprobs(stream).result()
    oldest_kept = clients[-(KEEP_VERSIONS + 1)].compute_logprobs(stream).result()
    newest = clients[-1].compute_logprobs(stream).result()
    assert oldest_kept != newest


def test_sample_returns_reproducible_completions(make_session, tiny) -> None:
    session = make_session()
    sampler = session.training_client.save_weights_and_get_sampling_client()
    prompt = _first_prompt(tiny)
    fmt = chat_format(tiny.processor)
    first = sampler.sample(prompt, 3, PARAMS, seed=5).result()
    second = sampler.sample(prompt, 3, PARAMS, seed=5).result()
    other = sampler.sample(prompt, 3, PARAMS, seed=6).result()
    assert isinstance(first, SampleResponse) and len(first.sequences) == 3
    for done in first.sequences:
        assert 1 <= len(done.tokens) <= 2 and len(done.logprobs) == len(done.tokens)
        assert done.stop_reason in ("stop", "length")
        assert done.stop_reason == ("stop" if done.tokens[-1] == fmt.im_end else "length")
        assert not set(done.tokens) & set(fmt.banned)
        assert all(lp < 0.0 for lp in done.logprobs)
        # the reported log-probs are the ones the rule gives the whole stream
        stream = append_reply(prompt, fmt, done.tokens, done.logprobs)
        assert _masked_max_diff(stream, sampler.compute_logprobs(stream).result()) < 1e-4
    assert [c.tokens for c in first.sequences] == [c.tokens for c in second.sequences]
    assert [c.logprobs for c in first.sequences] == [c.logprobs for c in second.sequences]
    assert [c.tokens for c in first.sequences] != [c.tokens for c in other.sequences]


# ------------------------------------------------------------------ what an update touches


def test_update_changes_only_lora_parameters(make_session, oracle_datums) -> None:
    session = make_session()
    trainable = session.host.trainable()
    assert trainable and all("lora_" in name for name in trainable)
    before = _state_dict(session)
    _step(session, oracle_datums)
    _step(session, oracle_datums)
    after = _state_dict(session)
    assert before.keys() == after.keys()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
    unchanged_base = [n for n in before if "lora_" not in n]
    assert len(unchanged_base) > 0


def test_full_finetune_trains_every_parameter_and_exports_a_model(
        make_session, oracle_datums, tmp_path) -> None:
    session = make_session(lora=None)
    model = session.host.lm.model
    names = [n for n, _ in model.named_parameters()]
    assert all(p.requires_grad for p in model.parameters())
    assert list(session.host.trainable()) == names
    assert not any("lora_" in n for n in names)
    before = _trainable(session)
    _step(session, oracle_datums)
    after = _trainable(session)
    changed = [n for n in names if not torch.equal(before[n], after[n])]
    assert any("language_model" in n for n in changed)
    folder = session.training_client.export(tmp_path / "full", "model").result()
    assert is_complete(Path(folder))
    loaded = load_model(folder)
    pad_id = loaded.processor.tokenizer.pad_token_id
    stream = oracle_datums[0].stream
    ours = session.submit(lambda h: _logits(h.lm.model, stream, pad_id)).result()
    assert torch.equal(_logits(loaded.model, stream, pad_id), ours)


def test_lora_model_export_merges_the_adapter(make_session, oracle_datums, tmp_path) -> None:
    session = make_session()
    _step(session, oracle_datums)
    folder = session.training_client.export(tmp_path / "merged", "model").result()
    loaded = load_model(folder)
    assert not any("lora_" in n for n in loaded.model.state_dict())
    pad_id = loaded.processor.tokenizer.pad_token_id
    stream = oracle_datums[0].stream
    ours = session.submit(lambda h: _logits(h.lm.model, stream, pad_id)).result()
    torch.testing.assert_close(_logits(loaded.model, stream, pad_id), ours, rtol=0, atol=1e-4)


# ------------------------------------------------------------------ state round trips


def test_state_round_trip_restores_weights_and_optimizer(make_session, oracle_datums,
                                                         tmp_path) -> None:
    a = make_session("a")
    _step(a, oracle_datums)
    _step(a, oracle_datums)
    path = a.training_client.save_state("two").result()
    assert Path(path) == tmp_path / "a" / "states" / "two"
    assert is_complete(Path(path))
    for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors",
                 "session.json", "COMPLETE"):
        assert (Path(path) / name).is_file()
    meta = json.loads((Path(path) / "session.json").read_text())
    assert meta["optimizer_steps"] == 2 and meta["base_weights_sha256"] == a.host.base_hash
    assert meta["lora"]["rank"] == 4 and meta["lora"]["alpha"] == 8

    b = create_session_from_state(path, spec=SessionSpec(workdir=str(tmp_path / "b")))
    c = create_session_from_state(path, with_optimizer=False,
                                  spec=SessionSpec(workdir=str(tmp_path / "c")))
    for s in (b, c):
        assert s.host.lora == LORA and s.host.opt_steps == 2
    loss_a = a.training_client.forward(oracle_datums).result().loss
    assert b.training_client.forward(oracle_datums).result().loss == loss_a
    assert c.training_client.forward(oracle_datums).result().loss == loss_a
    weights_a = _trainable(a)
    assert all(torch.equal(weights_a[n], t) for n, t in _trainable(b).items())

    steps = []
    for s in (a, b, c):
        s.training_client.forward_backward(oracle_datums, "cross_entropy")
        steps.append(s.training_client.optim_step(ADAM).result())
    assert [o.step for o in steps] == [3, 3, 3]
    assert steps[0].grad_norm == steps[1].grad_norm == steps[2].grad_norm
    after_a, after_b, after_c = _trainable(a), _trainable(b), _trainable(c)
    assert after_a.keys() == after_b.keys() == after_c.keys()
    assert all(torch.equal(after_a[n], after_b[n]) for n in after_a)  # moments restored
    assert not all(torch.equal(after_a[n], after_c[n]) for n in after_a)  # moments missing
    for s in (b, c):
        s.close()


def test_save_state_after_sampling_saves_the_trainers_weights(make_session, oracle_datums,
                                                              tmp_path) -> None:
    a = make_session("a")
    old = a.training_client.save_weights_and_get_sampling_client()
    _step(a, oracle_datums)
    trained = _trainable(a)
    old.compute_logprobs(oracle_datums[0].stream).result()  # version 0 now in the model
    path = a.training_client.save_state("after").result()
    b = create_session_from_state(path, spec=SessionSpec(workdir=str(tmp_path / "b")))
    assert all(torch.equal(trained[n], t) for n, t in _trainable(b).items())
    loss = a.training_client.forward(oracle_datums).result().loss
    assert b.training_client.forward(oracle_datums).result().loss == loss
    b.close()


def test_close_frees_the_policy_its_variables_still_name(make_session, oracle_datums) -> None:
    """close() moves the policy to the meta device and drops the optimiser's moments, so a
    notebook that closes a session and opens another (notebook 03's run after its own session)
    gets the memory back while its variables still name the first; a second close is fine."""
    session = make_session()
    _step(session, oracle_datums)
    host = session.host
    assert host.optimizer.state and {p.device.type for p in host.lm.model.parameters()} == {"cpu"}
    session.close()
    assert not host.optimizer.state
    assert {p.device.type for p in host.lm.model.parameters()} == {"meta"}
    session.close()


def test_incomplete_checkpoint_is_refused(make_session, oracle_datums, tmp_path) -> None:
    session = make_session()
    tc = session.training_client
    _step(session, oracle_datums)
    path = Path(tc.save_state("done").result())
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / checkpoint.COMPLETE).unlink()
    assert is_complete(path) and not is_complete(broken)
    _step(session, oracle_datums)
    before = _trainable(session)
    with pytest.raises(IncompleteCheckpoint, match="COMPLETE"):
        tc.load_state(broken).result()
    with pytest.raises(IncompleteCheckpoint):
        tc.load_state(tmp_path / "never_written").result()
    after = _trainable(session)
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing was touched
    assert session.host.opt_steps == 2


def test_atomic_folder_leaves_nothing_behind_on_failure(tmp_path) -> None:
    final = tmp_path / "ckpt"

    def ok(tmp: Path) -> None:
        (tmp / "data.txt").write_text("v1")

    def fail(tmp: Path) -> None:
        (tmp / "data.txt").write_text("half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        checkpoint.atomic_folder(final, fail)
    assert list(tmp_path.iterdir()) == []
    checkpoint.atomic_folder(final, ok)
    with pytest.raises(RuntimeError):
        checkpoint.atomic_folder(final, fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (final / "data.txt").read_text() == "v1" and is_complete(final)


def test_state_from_another_base_is_refused(make_session, oracle_datums, tmp_path) -> None:
    session = make_session("a")
    _step(session, oracle_datums)
    path = session.training_client.save_state("s").result()
    adapter = session.training_client.export(tmp_path / "adapter", "adapter").result()
    other_dir = build_tiny(tmp_path / "tiny_seed1", TinySpec(seed=1))
    other = make_session("other", model=other_dir)
    assert other.host.base_hash != session.host.base_hash
    with pytest.raises(ValueError, match="base"):
        other.training_client.load_state(path).result()
    with pytest.raises(ValueError, match="base"):
        other.training_client.load_adapter(adapter).result()


# ------------------------------------------------------------------ PEFT export


def test_exported_adapter_loads_in_plain_peft(make_session, oracle_datums, tiny_dir,
                                              tmp_path) -> None:
    from peft import PeftModel

    session = make_session()
    _step(session, oracle_datums)
    folder = Path(session.training_client.export(tmp_path / "adapter", "adapter").result())
    for name in ("adapter_config.json", "adapter_model.safetensors", "workbench_adapter.json",
                 "COMPLETE"):
        assert (folder / name).is_file()
    meta = json.loads((folder / "workbench_adapter.json").read_text())
    assert meta["base_weights_sha256"] == session.host.base_hash
    assert meta["optimizer_steps"] == 1 and meta["lora"]["rank"] == 4
    assert meta["base_model"] == str(tiny_dir)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)

    base = load_model(str(tiny_dir))
    pad_id = base.processor.tokenizer.pad_token_id
    stream = oracle_datums[0].stream
    peft_model = PeftModel.from_pretrained(base.model, str(folder)).eval()
    ours = session.submit(lambda h: _logits(h.lm.model, stream, pad_id)).result()
    theirs = _logits(peft_model, stream, pad_id)
    assert torch.equal(theirs, ours)
    with peft_model.disable_adapter():
        assert not torch.allclose(_logits(peft_model, stream, pad_id), ours)

    # and back into a fresh session of the same base
    fresh = make_session("fresh")
    fresh.training_client.load_adapter(folder).result()
    assert torch.equal(fresh.submit(lambda h: _logits(h.lm.model, stream, pad_id)).result(),
                       ours)


def test_a_name_saves_under_the_workdir_and_a_folder_where_it_says(make_session,
                                                                   tmp_path) -> None:
    tc = make_session("w").training_client
    path = tc.export("v0", "adapter").result()
    assert path == str(tmp_path / "w" / "exports" / "v0")
    assert (Path(path) / "adapter_model.safetensors").is_file() and is_complete(Path(path))
    assert tc.save_state("s0").result() == str(tmp_path / "w" / "states" / "s0")
    assert tc.save_state(str(tmp_path / "elsewhere")).result() == str(tmp_path / "elsewhere")
    assert tc.export(tmp_path / "mine", "adapter").result() == str(tmp_path / "mine")
    with pytest.raises(ValueError, match=r"kind 'lora'; choose one of \['adapter', 'model'\]"):
        tc.export("v1", "lora")
    with pytest.raises(ValueError, match="a name or a folder"):
        tc.save_state("")



def test_truncated_is_weights_the_policy_gradient_by_the_capped_sampler_ratio(
        make_session) -> None:
    """LossConfig.tis_cap through a session. With the sampler's own log-probs every weight is 1
    and PPO with TIS takes PPO's step. With the sampler's log-probs lowered by 0.5 on every
    reply token (a sampler whose numerics differ), plain PPO's ratio e^0.5 is clipped on every
    token, while TIS weighs each token by min(e^0.5, 1.5) = 1.5 and keeps PPO's on-policy
    gradient: its squared norms are 1.5^2 times those of the first case."""
    session = make_session()
    tc = session.training_client
    episodes = tc.save_weights_and_get_sampling_client().play(
        play_episodes, SMALL, eval_set(5, 2), 2, PARAMS, seed=0).result()
    datums = _rl_datums(episodes)
    lowered = [replace(d, stream=replace(d.stream, logprobs_T=[
        lp - 0.5 * m for lp, m in zip(d.stream.logprobs_T, d.stream.loss_mask_T)]))
        for d in datums]
    ppo, tis = LossConfig(), LossConfig(tis_cap=1.5)
    exact = tc.grad_squares(datums, "ppo", ppo).result()
    assert tc.grad_squares(datums, "ppo", tis).result() == pytest.approx(exact, rel=1e-5)
    weighted = tc.grad_squares(lowered, "ppo", tis).result()
    assert weighted == pytest.approx({k: 1.5**2 * v for k, v in exact.items()}, rel=1e-4)
    clipped = tc.forward(lowered, "ppo", ppo).result().metrics
    metrics = tc.forward(lowered, "ppo", tis).result().metrics
    assert clipped["clip_fraction"] == 1.0 and "tis_truncated_fraction" not in clipped
    assert (metrics["clip_fraction"], metrics["tis_truncated_fraction"]) == (0.0, 1.0)
    assert metrics["kl_sampler_trainer"] == pytest.approx(clipped["kl_sampler_trainer"])
