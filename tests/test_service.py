"""The session server driven by the official `tinker` SDK (0.38.0), on tiny-sft, on the CPU:
a multi-turn maze RL loop written with the SDK's classes samples the same tokens as the
workbench's own clients and its loss agrees; the four losses; states and sampler weights;
several users at once, each as if alone; seq_id order; heartbeats; usage; the queue."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker", reason="needs the service extra (pip install "
                             "'workbench[service]')")
os.environ["TINKER_TELEMETRY"] = "0"  # the SDK's telemetry would go to our server

import httpx  # noqa: E402
from tinker import types  # noqa: E402

from workbench.advantages import grpo_advantages  # noqa: E402
from workbench.config import PRESETS, apply_overrides  # noqa: E402
from workbench.model import LoraSettings  # noqa: E402
from workbench.policy import SamplingParams, append_reply, chat_format, start_stream  # noqa: E402
from workbench.rl.rollout import Episode, observe, record_step  # noqa: E402
from workbench.rl.schedule import step_mazes  # noqa: E402
from workbench.serve.engine import key_hash  # noqa: E402
from workbench.service import ServiceSettings, start  # noqa: E402
from workbench.service.sdk import completion, model_input, rl_datum  # noqa: E402
from workbench.session import (  # noqa: E402
    AdamParams,
    LossConfig,
    SessionSpec,
    create_session,
    datum_from_stream,
)

KEY = "tml-test-key"
LORA = LoraSettings(rank=8, alpha=16, init_seed=0, vision=True)
CONFIG = apply_overrides(PRESETS["tiny"], ["generator.max_turns=3", "trainer.train_batch_size=2"])


def spec(model: str, folder: Path) -> SessionSpec:
    return SessionSpec(model=model, lora=LORA, workdir=str(folder))


@pytest.fixture(scope="module")
def server(sft_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    running = start(spec(sft_model, tmp_path_factory.mktemp("service")),
                    ServiceSettings(api_key_sha256=key_hash(KEY), poll_s=5), log=lambda _: None)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def local(sft_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The same spec as the server's, in this process: the workbench's own clients, put back
    to their first weights and optimiser (`fresh`) by each test that compares with them."""
    session = create_session(spec(sft_model, tmp_path_factory.mktemp("local")))
    session.initial = session.training_client.save_state("initial").result()
    yield session
    session.close()


def fresh(local: Any) -> Any:
    """The local session's training client, back at its first weights and optimiser."""
    local.training_client.load_state(local.initial).result()
    return local.training_client


def sdk(server: Any) -> Any:
    return tinker.ServiceClient(base_url=server.url, api_key=KEY)


def play(sample: Any, processor: Any, states: list[Any], n: int, seed: int
         ) -> list[list[Episode]]:
    """n episodes a maze, one reply at a time: sample(prompt stream, seed) -> Completion."""
    task, fmt = CONFIG.task, chat_format(processor)
    system = start_stream(processor, fmt, task.rules())
    out = []
    for p, state in enumerate(states):
        group = []
        for g in range(n):
            env = task.make_env()
            obs, info = env.reset(options={"init_state": state})
            ep = Episode(init_state=state, positions=[env.pos])
            stream = observe(system, processor, fmt, obs, info, task)
            for turn in range(task.max_turns):
                done = sample(stream, seed + 1000 * p + 100 * g + turn)
                ep.sampled_tokens.append(list(done.tokens))
                stream = append_reply(stream, fmt, done.tokens, done.logprobs)
                obs, info = record_step(ep, env, processor.tokenizer.decode(
                    done.tokens, skip_special_tokens=True))
                if env.done:
                    break
                stream = observe(stream, processor, fmt, obs, info, task)
            ep.stream = stream
            group.append(ep)
        out.append(group)
    return out


def trained(episodes_P_G: list[list[Episode]]) -> list[tuple[Any, float]]:
    """(stream, advantage) of every episode with a non-zero GRPO advantage."""
    rewards = np.array([[ep.reward for ep in group] for group in episodes_P_G])
    return [(ep.stream, float(a)) for group, adv in zip(episodes_P_G, grpo_advantages(rewards))
            for ep, a in zip(group, adv) if a != 0.0]


def test_the_sdk_plays_mazes_with_images_and_trains_as_the_workbench_loop_does(
        server: Any, local: Any) -> None:
    """Two iterations of sample -> reward -> importance_sampling -> optim_step: the SDK through
    the server and the workbench's clients in this process sample the same tokens (images
    sent as PNG chunks), and their summed losses agree within 1e-4 (relative)."""
    tc = sdk(server).create_lora_training_client(base_model=server.service.base_model,
                                                 rank=LORA.rank, seed=LORA.init_seed).result()
    ours = fresh(local)
    processor = ours.get_processor()
    params = SamplingParams(max_tokens=CONFIG.generator.max_tokens, temperature=1.0)
    sdk_params = types.SamplingParams(max_tokens=params.max_tokens, temperature=1.0)
    losses = []
    for it in (1, 2):
        states = step_mazes(CONFIG, it)
        sdk_sampler = tc.save_weights_and_get_sampling_client().result()
        our_sampler = ours.save_weights_and_get_sampling_client()
        by_sdk = play(lambda s, seed, c=sdk_sampler: completion(c.sample(
            model_input(s), 1, sdk_params.model_copy(update={"seed": seed})).result()
            .sequences[0]), processor, states, 2, 100 * it)
        by_us = play(lambda s, seed, c=our_sampler: c.sample(s, 1, params, seed).result()
                     .sequences[0], processor, states, 2, 100 * it)
        assert [[e.sampled_tokens for e in g] for g in by_sdk] == \
            [[e.sampled_tokens for e in g] for g in by_us]
        assert sum(len(e.images) for e in (ep.stream for g in by_us for ep in g)) > 4
        batch = trained(by_us) or [(by_us[0][0].stream, 1.0)]  # never an empty update
        fb = tc.forward_backward([rl_datum(s, a) for s, a in batch], "importance_sampling")
        mine = ours.forward_backward([datum_from_stream(s, a) for s, a in batch],
                                     "importance_sampling", LossConfig(reduction="sum"))
        theirs, expected = fb.result().metrics["loss:sum"], mine.result().loss
        losses.append((theirs, expected))
        assert theirs == pytest.approx(expected, rel=1e-4, abs=1e-6)
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        ours.optim_step(AdamParams(learning_rate=1e-3)).result()
    assert losses[0] != losses[1]


def _one_datum(local: Any, processor: Any) -> tuple[Any, float]:
    """A played episode of the local session: its stream and an advantage."""
    sampler = fresh(local).save_weights_and_get_sampling_client()
    [[ep]] = play(lambda s, seed: sampler.sample(s, 1, SamplingParams(max_tokens=4), seed)
                  .result().sequences[0], processor, step_mazes(CONFIG, 3)[:1], 1, 7)
    return ep.stream, 0.75


@pytest.mark.parametrize("loss_fn,config,ours", [
    ("cross_entropy", None, LossConfig(reduction="sum")),
    ("importance_sampling", None, LossConfig(reduction="sum")),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
     LossConfig(clip_low=0.1, clip_high=0.1, reduction="sum")),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5},
     LossConfig(cispo_min=0.5, cispo_max=1.5, reduction="sum")),
])
def test_each_loss_is_tinkers_sum_over_the_tokens(server: Any, local: Any, loss_fn: str,
                                                  config: Any, ours: LossConfig) -> None:
    """forward (no gradient) through the SDK: each of the four losses with its thresholds, and
    the per-target log-probs, equal the workbench's forward of the same datum."""
    processor = fresh(local).get_processor()
    stream, advantage = _one_datum(local, processor)
    tc = sdk(server).create_lora_training_client(base_model=server.service.base_model,
                                                 rank=LORA.rank, seed=LORA.init_seed).result()
    if loss_fn == "cross_entropy":
        mask = np.asarray(stream.loss_mask_T[1:], dtype=np.float32)
        datum = types.Datum(model_input=model_input(stream, len(stream) - 1), loss_fn_inputs={
            "target_tokens": np.asarray(stream.tokens_T[1:], dtype=np.int64), "weights": mask})
        mine = datum_from_stream(stream, 0.0)
    else:
        datum, mine = rl_datum(stream, advantage), datum_from_stream(stream, advantage)
    out = tc.forward([datum], loss_fn, config).result()
    expected = local.training_client.forward([mine], loss_fn, ours).result()
    assert out.metrics["loss:sum"] == pytest.approx(expected.loss, rel=1e-5, abs=1e-6)
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (len(stream) - 1,)
    known = np.isfinite(logprobs)  # NaN: a target that is not the next token (none here)
    assert known.all()
    np.testing.assert_allclose(logprobs, expected.logprobs_B_T[0][1:], rtol=1e-5, atol=1e-5)


def test_states_sampler_weights_and_the_base_round_trip(server: Any, local: Any) -> None:
    """save_state -> a new training client from it (with the optimiser) steps exactly as the
    first does; named sampler weights sample what the live version samples; a sampler on the
    base samples what a fresh adapter (B = 0) samples."""
    client = sdk(server)
    processor = local.training_client.get_processor()
    stream, advantage = _one_datum(local, processor)
    datum = rl_datum(stream, advantage)
    tc = client.create_lora_training_client(base_model=server.service.base_model,
                                            rank=4, seed=3).result()
    tc.forward_backward([datum], "ppo").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("after-one").result().path
    assert path.endswith("/weights/after-one")
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    steps = []
    for c in (tc, resumed):
        c.forward_backward([datum], "ppo").result()
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        steps.append(c.forward([datum], "ppo").result().metrics["loss:sum"])
    assert steps[0] == steps[1]
    tc.load_state_with_optimizer(path).result()  # back into this client, in its call order
    tc.forward_backward([datum], "ppo").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert tc.forward([datum], "ppo").result().metrics["loss:sum"] == steps[0]
    prompt = model_input(stream, 40)
    params = types.SamplingParams(max_tokens=6, seed=11)
    live = tc.save_weights_and_get_sampling_client().result().sample(
        prompt, 3, params).result()
    named = tc.save_weights_for_sampler("s1").result().path
    saved = client.create_sampling_client(model_path=named).result().sample(
        prompt, 3, params).result()
    assert [s.tokens for s in saved.sequences] == [s.tokens for s in live.sequences]
    base = client.create_sampling_client(base_model=server.service.base_model).result()
    new = client.create_lora_training_client(base_model=server.service.base_model,
                                             rank=2).result()
    a = base.sample(prompt, 2, params, include_prompt_logprobs=True).result()
    b = new.save_weights_and_get_sampling_client().result().sample(
        prompt, 2, params, include_prompt_logprobs=True).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert a.prompt_logprobs[0] is None and a.prompt_logprobs[1:] == b.prompt_logprobs[1:]
    listed = tinker.RestClient(base_url=server.url, api_key=KEY).list_checkpoints(
        tc.model_id).result()
    assert {c.tinker_path for c in listed.checkpoints} == {path, named}


def test_two_users_side_by_side_each_train_as_if_alone(server: Any, local: Any) -> None:
    """Two sessions, a LoRA each (ranks 8 and 3) over the one base, their calls interleaved:
    each one's losses equal the same calls made alone."""
    processor = local.training_client.get_processor()
    stream, advantage = _one_datum(local, processor)
    datum = rl_datum(stream, advantage)

    def steps(tc: Any, n: int) -> list[Any]:
        out = []
        for _ in range(n):
            out.append(tc.forward_backward([datum], "cispo"))
            out.append(tc.optim_step(types.AdamParams(learning_rate=5e-3)))
        return out

    def losses(futures: list[Any]) -> list[float]:
        return [f.result().metrics["loss:sum"] for f in futures[::2]]

    base = server.service.base_model
    def new(rank: int, seed: int) -> Any:
        return sdk(server).create_lora_training_client(base, rank=rank, seed=seed).result()

    alone_a, alone_b = losses(steps(new(8, 1), 3)), losses(steps(new(3, 2), 3))
    a, b = new(8, 1), new(3, 2)
    fa, fb = [], []
    for _ in range(3):  # interleaved: a, b, a, b ... all in flight before any is read
        fa += steps(a, 1)
        fb += steps(b, 1)
    assert losses(fa) == alone_a and losses(fb) == alone_b
    assert alone_a != alone_b


def test_a_rank_above_the_served_one_and_another_base_are_refused(server: Any) -> None:
    client = sdk(server)
    with pytest.raises(tinker.NotFoundError, match="is not served here"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-VL-8B-Instruct",
                                           rank=8).result()
    with pytest.raises(Exception, match=f"rank 1 to {LORA.rank}"):
        client.create_lora_training_client(base_model=server.service.base_model,
                                           rank=64).result()


# ------------------------------------------------------------------- the protocol by hand

def post(server: Any, path: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}/api/v1/{path}", json=body,
                      headers={"X-API-Key": KEY, **headers}, timeout=30)


def result(server: Any, request_id: str) -> Any:
    while True:
        out = post(server, "retrieve_future", {"request_id": request_id}).json()
        if out.get("type") != "try_again":
            return out


def new_model(server: Any, rank: int = 2) -> tuple[str, str]:
    sid = post(server, "create_session", {"tags": [], "user_metadata": {}}).json()["session_id"]
    made = post(server, "create_model", {"session_id": sid, "model_seq_id": 0,
                                         "base_model": server.service.base_model,
                                         "lora_config": {"rank": rank}}).json()
    assert result(server, made["request_id"])["model_id"] == made["model_id"]
    return sid, made["model_id"]


def test_calls_run_in_seq_id_order_and_a_repeat_gets_the_first_id(server: Any) -> None:
    """seq_id 2 (an optimiser step) sent before seq_id 1 (a save) waits for it; seq_id 1 sent
    twice is one call; a seq_id that ran already is refused."""
    _, model = new_model(server)
    adam = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    second = post(server, "optim_step", {"model_id": model, "seq_id": 2, "adam_params": adam})
    first = post(server, "save_weights", {"model_id": model, "seq_id": 1, "path": "zero"})
    again = post(server, "save_weights", {"model_id": model, "seq_id": 1, "path": "zero"})
    assert first.json()["request_id"] == again.json()["request_id"]
    assert result(server, second.json()["request_id"])["metrics"]["optimizer_step:max"] == 1.0
    assert result(server, first.json()["request_id"])["path"].endswith("/weights/zero")
    stale = post(server, "optim_step", {"model_id": model, "seq_id": 1, "adam_params": adam})
    assert stale.status_code == 200 and stale.json() == first.json()  # the first call's id
    late = post(server, "optim_step", {"model_id": model, "seq_id": 0, "adam_params": adam})
    assert late.status_code == 400 and "ran already" in late.json()["detail"]


def test_usage_counts_the_tokens_of_each_call_and_is_written_to_the_run_folder(
        server: Any, local: Any) -> None:
    processor = local.training_client.get_processor()
    stream, advantage = _one_datum(local, processor)
    client = sdk(server)
    tc = client.create_lora_training_client(base_model=server.service.base_model,
                                            rank=2).result()
    tc.forward_backward([rl_datum(stream, advantage)], "importance_sampling").result()
    tc.forward([rl_datum(stream, advantage)], "importance_sampling").result()
    out = tc.save_weights_and_get_sampling_client().result().sample(
        model_input(stream, 30), 3, types.SamplingParams(max_tokens=5, seed=1)).result()
    sid = tc.model_id.split(":")[0]
    usage = httpx.get(f"{server.url}/api/v1/sessions/{sid}/usage",
                      headers={"X-API-Key": KEY}).json()
    assert usage == {"session_id": sid, "ended": "", "prompt_tokens": 30,
                     "sampled_tokens": sum(len(s.tokens) for s in out.sequences),
                     "trained_tokens": len(stream) - 1, "forward_tokens": len(stream) - 1}
    lines = [json.loads(x) for x in (Path(server.service.workdir) / "usage.jsonl")
             .read_text().splitlines()]
    mine = [x for x in lines if x["session_id"] == sid]
    assert sum(x["sampled_tokens"] for x in mine) == usage["sampled_tokens"]
    assert sum(x["trained_tokens"] for x in mine) == usage["trained_tokens"]


@pytest.fixture
def strict(sft_model: str, tmp_path: Path) -> Iterator[Any]:
    """A server with a 1 s heartbeat limit and a queue of 2."""
    running = start(spec(sft_model, tmp_path), ServiceSettings(
        api_key_sha256=key_hash(KEY), session_timeout_s=1.0, max_queue=2, poll_s=1),
        log=lambda _: None)
    yield running
    running.stop()


def test_a_session_without_heartbeats_ends_and_past_the_queue_calls_get_429(
        strict: Any) -> None:
    sid, model = new_model(strict)
    adam = {"learning_rate": 1e-3}
    # seq_ids 2 and 3 wait for 1, which never comes: two calls held, the queue's limit
    held = [post(strict, "optim_step", {"model_id": model, "seq_id": seq, "adam_params": adam})
            for seq in (2, 3)]
    assert [h.status_code for h in held] == [200, 200]
    full = post(strict, "optim_step", {"model_id": model, "seq_id": 4, "adam_params": adam})
    assert full.status_code == 429 and full.headers["Retry-After"] == "1"
    assert "max_queue 2" in full.json()["detail"]
    while not strict.service.clients[sid].ended:  # no heartbeat: ended within ~1 s
        httpx.get(f"{strict.url}/api/v1/healthz", headers={"X-API-Key": KEY})
    for h in held:  # their turn never came: each fails, and the queue is free again
        assert "ended (no heartbeat for 1 s) before this call's turn" in \
            result(strict, h.json()["request_id"])["error"]
    assert not any(not c.future.done() for c in strict.service.calls.values())
    assert post(strict, "session_heartbeat", {"session_id": sid}).status_code == 410
    gone = post(strict, "optim_step", {"model_id": model, "seq_id": 1, "adam_params": adam})
    assert gone.status_code == 404
    ended = [json.loads(x) for x in (Path(strict.service.workdir) / "usage.jsonl")
             .read_text().splitlines() if '"end"' in x]
    assert ended[-1]["session_id"] == sid and "no heartbeat for 1 s" in ended[-1]["why"]


def test_the_server_runs_a_ray_session_with_two_users_as_in_process(
        sft_model: str, tmp_path: Path, ray_temp_dir: Path, server: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """spec.cluster.address=local: the same calls on a trainer and a sampler actor; two users'
    steps give the losses the in-process server gives, a state saves and samples come back."""
    from workbench.cluster import disconnect
    from workbench.session import ClusterSpec

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token written to ~/.ray
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray_spec = spec(sft_model, tmp_path)
    ray_spec = SessionSpec(model=ray_spec.model, lora=LORA, workdir=ray_spec.workdir,
                           cluster=ClusterSpec(address="local", num_cpus=2,
                                               temp_dir=str(ray_temp_dir)))
    on_ray = start(ray_spec, ServiceSettings(api_key_sha256=key_hash(KEY), poll_s=5),
                   log=lambda _: None)
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": ids[1:], "weights": [1.0] * 7})

    def losses(s: Any) -> list[float]:
        a = sdk(s).create_lora_training_client(s.service.base_model, rank=4, seed=1).result()
        b = sdk(s).create_lora_training_client(s.service.base_model, rank=8, seed=2).result()
        out = []
        for c in (a, b, a, b):
            out.append(c.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
            c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sample = a.save_weights_and_get_sampling_client().result().sample(
            types.ModelInput.from_ints(ids), 2, types.SamplingParams(max_tokens=4, seed=1))
        assert a.save_state("s").result().path.endswith("/weights/s")
        return out + [tuple(x.tokens) for x in sample.result().sequences]

    try:
        assert on_ray.service.session.describe()["backend"]["kind"] == "ray"
        ray_run, here = losses(on_ray), losses(server)
        assert ray_run[:4] == pytest.approx(here[:4], rel=1e-5)
        assert ray_run[4:] == here[4:]  # the same sampled tokens
    finally:
        on_ray.stop()
        disconnect()


def test_token_ids_are_checked_against_the_models_vocabulary_not_the_tokenizers(
        tmp_path: Path) -> None:
    """The small shape's embedding has Qwen3-VL's 151,936 rows over a tokenizer of about 500, as
    a real model's has padding rows past its tokenizer: a sampler may emit any of those rows, so
    the server takes them back in a datum, and refuses a token past the embedding."""
    from workbench.model.presets import SHAPES, save_random

    vocab = SHAPES["qwen3-vl-small-shape"].vocab
    model = save_random("qwen3-vl-small-shape", tmp_path / "model", torch.float32)
    running = start(spec(model, tmp_path / "run"), ServiceSettings(api_key_sha256=key_hash(KEY)),
                    log=lambda _: None)
    try:
        tc = sdk(running).create_lora_training_client(base_model=running.service.base_model,
                                                      rank=LORA.rank).result()
        assert len(tc.get_tokenizer()) < 1000 < vocab - 1

        def forward(tokens: list[int]) -> Any:
            return tc.forward([types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                    "target_tokens": np.asarray(tokens[1:], np.int64),
                    "weights": np.ones(len(tokens) - 1, np.float32)})], "cross_entropy").result()

        out = forward([1, vocab - 1, 3, 4])
        assert np.isfinite(out.loss_fn_outputs[0]["logprobs"].to_numpy()).all()
        with pytest.raises(tinker.BadRequestError, match=f"token id {vocab}: the model's "
                                                          f"vocabulary has {vocab} tokens"):
            forward([1, vocab, 3, 4])
    finally:
        running.stop()
