"""The vLLM sampler engine's glue: selection, requests, completions, a rollout end to end.

vLLM cannot run here: it is a CUDA-only wheel. So, apart from the last two tests (skipped unless
vllm imports and CUDA is available: they pass on an H200 with vLLM 0.26.0), these tests inject a
FAKE `vllm` module into sys.modules. It records what our engine asks of it and answers the way
vLLM documents (prompt image pads expanded, fixed move words with log-probs, prefix-cache
counters). This is the only mock in the suite: it checks our request/response glue, not vLLM.
"""

from __future__ import annotations

import json
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from workbench.config import ConfigError, RunConfig, apply_overrides
from workbench.engines import make_engine
from workbench.envs import (
    MazeConfig,
    MazeEnv,
    eval_set,
    format_action,
    oracle_actions,
    system_prompt,
)
from workbench.model import LoraSettings
from workbench.opener import session_spec
from workbench.policy import (
    Completion,
    SamplingParams,
    Stream,
    append_reply,
    chat_format,
    encode_image,
    start_stream,
)
from workbench.policy.engine import EngineSettings
from workbench.rl import phases
from workbench.rl.rollout import observe, play_episodes
from workbench.sampler.engine import TransformersEngine
from workbench.session import Session, SessionSpec, create_session, datum_from_stream
from workbench.session.types import AdamParams
from workbench.vllm.args import check_memory_share, checked_max_len, engine_kwargs, max_lora_rank
from workbench.vllm.engine import (
    BAN_BIAS,
    VLLMEngine,
    check_prompt,
    expand_image_pads,
    prompt_token_ids,
    to_completion,
    turn_seed,
    vllm_prompt,
)
from workbench.vllm.render import RowRequests, old_items

LORA = LoraSettings(rank=8, alpha=16)
SMALL = MazeConfig(size=5, max_turns=4)
SCRIPT = ("right", "down", "stop")  # the fake's reply on generate call 1, 2, 3


# ------------------------------------------------------------------ the fake vllm module


@dataclass
class FakeOutput:
    """vllm.CompletionOutput's fields we read."""

    token_ids: list[int]
    logprobs: list[dict[int, Any]]
    finish_reason: str = "stop"


@dataclass
class FakeRequestOutput:
    """vllm.RequestOutput's fields we read."""

    prompt_token_ids: list[int]
    outputs: list[FakeOutput]
    request_id: str = ""
    finished: bool = True


@dataclass(frozen=True)
class FakeRange:
    """vllm.multimodal.inputs.PlaceholderRange's fields we move."""

    offset: int
    length: int


class MultiModalProcessorSenderCache:
    """vLLM's front-end mirror of its engine core's processor cache (its class name is how the
    engine knows it): the content ids held, least recently used first."""

    def __init__(self) -> None:
        self.held: dict[str, None] = {}

    def is_cached_item(self, mm_hash: str) -> bool:
        return mm_hash in self.held

    def touch_sender_cache_item(self, mm_hash: str) -> None:
        self.held.pop(mm_hash, None)
        self.held[mm_hash] = None


@dataclass
class FakeVLLM:
    """State of the fake: what LLM() and generate() were called with, and how to answer."""

    reply_ids: Callable[[int], list[int]]  # generate call index -> reply token ids
    image_tokens: Callable[[Any], int]  # PIL image -> token count (vLLM runs the HF processor)
    image_pad: int  # <|image_pad|>: each one in a prompt is expanded to its image's tokens
    llm_kwargs: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    seen: list[list[int]] = field(default_factory=list)  # prompts run (expanded), for the cache
    cache_queries: int = 0  # prefix-cache counters as vLLM counts them (token granularity here)
    cache_hits: int = 0
    loaded: list[list[tuple[str, torch.Tensor]]] = field(default_factory=list)  # merged pushes
    payloads: list[type] = field(default_factory=list)  # bytes (shared) or list (in-process)
    rpcs: list[str] = field(default_factory=list)  # collective_rpc methods, in order
    resets: int = 0  # reset_prefix_cache() calls
    enqueued: list[dict[str, Any]] = field(default_factory=list)  # add_request's, in order
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)  # the same, by id
    renders: list[dict[str, Any]] = field(default_factory=list)  # prompts render_cmpl got
    mm_cache: Any = None  # the renderer's processor cache (a MultiModalProcessorSenderCache)
    queue: list[str] = field(default_factory=list)  # ids of enqueued requests not yet finished
    events: list[tuple[str, str]] = field(default_factory=list)  # ("sent" | "done", request id)
    aborted: list[str] = field(default_factory=list)  # llm_engine.abort_request's ids
    shutdowns: int = 0  # llm_engine.engine_core.shutdown() calls
    encoder_resets: int = 0  # llm_engine.reset_encoder_cache() calls

    def logprob(self, call: int, position: int) -> float:
        return -0.125 * (call + 1) - 0.01 * position

    def answer(self, prompt: dict, call: int) -> FakeRequestOutput:
        """The output for one prompt (a TokensPrompt, or an engine input the renderer made):
        its image pads expanded, reply_ids(call) with their log-probs."""
        reply = self.reply_ids(call)
        expanded = prompt["prompt_token_ids"] if "type" in prompt else self.render(prompt, False)
        self.count_cache(expanded)
        lps = [{tok: types.SimpleNamespace(logprob=self.logprob(call, k))}
               for k, tok in enumerate(reply)]
        return FakeRequestOutput(expanded, [FakeOutput(list(reply), lps)])

    def render(self, prompt: dict, cached: bool = True) -> Any:
        """LLM.renderer.render_cmpl on one TokensPrompt, as vLLM 0.26 renders one: each image
        pad expanded to its image's tokens (a placeholder range each), its content id as its
        hash, and its tensors sent unless the processor cache holds them (then None; the cache
        touched, in order). cached=False: just the expanded token ids."""
        images = iter(prompt.get("multi_modal_data", {}).get("image", []))
        ids: list[int] = []
        ranges = []
        for tok in prompt["prompt_token_ids"]:
            count = self.image_tokens(next(images)) if tok == self.image_pad else 1
            if tok == self.image_pad:
                ranges.append(FakeRange(len(ids), count))
            ids += [tok] * count
        if not cached:
            return ids
        self.renders.append(prompt)
        hashes = list(prompt.get("multi_modal_uuids", {}).get("image", []))
        if not hashes:
            return {"type": "token", "prompt_token_ids": ids}
        items = [None if self.mm_cache.is_cached_item(h) else f"tensors of {h}" for h in hashes]
        for h in hashes:
            self.mm_cache.touch_sender_cache_item(h)
        return {"type": "multimodal", "prompt_token_ids": ids, "arrival_time": 0.0,
                "mm_kwargs": {"image": items}, "mm_hashes": {"image": hashes},
                "mm_placeholders": {"image": ranges}}

    def generate(self, prompts: list[dict], params: list[Any], lora_request: Any = None,
                 use_tqdm: bool = True) -> list[FakeRequestOutput]:
        call = len(self.calls)
        self.calls.append(dict(prompts=prompts, params=params, lora=lora_request))
        return [self.answer(prompt, call) for prompt in prompts]

    def add_request(self, request_id: str, prompt: dict, params: Any,
                    lora_request: Any = None) -> str:
        """llm_engine.add_request of a rendered engine input: queued, answered by later
        llm_engine.step() calls. A request's reply is reply_ids(turn), its turn counted by its
        images (a maze turn adds one), so a streamed rollout gets the replies a rollout of one
        generate per turn gets. Like vLLM 0.26 it returns the id with '-' and 8 random
        characters, which the outputs leave out."""
        assert prompt["type"] == "multimodal" and request_id not in self.requests
        turn = len(prompt["mm_hashes"]["image"]) - 1
        self.requests[request_id] = dict(id=request_id, prompt=prompt, params=params,
                                         lora=lora_request, turn=turn)
        self.enqueued.append(self.requests[request_id])
        self.queue.append(request_id)
        self.events.append(("sent", request_id))
        return f"{request_id}-{np.random.default_rng().integers(16**8):08x}"

    def step(self) -> list[FakeRequestOutput]:
        """llm_engine.step(): the two requests queued last are finished, newest first (vLLM
        finishes requests in any order)."""
        done = [self.queue.pop() for _ in range(min(2, len(self.queue)))]
        outputs = []
        for request in done:
            sent = self.requests[request]
            out = self.answer(sent["prompt"], sent["turn"])
            outputs.append(replace(out, request_id=request))
            self.events.append(("done", request))
        return outputs

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        self.queue = [r for r in self.queue if r not in request_ids]


    def count_cache(self, prompt: list[int]) -> None:
        """A prompt's tokens are looked up; those in the longest prefix shared with an earlier
        prompt are found (vLLM matches whole KV blocks; the fake, single tokens)."""
        def shared(a: list[int], b: list[int]) -> int:
            return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

        self.cache_queries += len(prompt)
        self.cache_hits += max((shared(prompt, old) for old in self.seen), default=0)
        self.seen.append(prompt)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """LLM.collective_rpc on one worker: the worker extension named in LLM(...) (our real
        MergedWeightsWorker class) on the CPU, its model's load_weights recorded."""
        self.rpcs.append(method)
        if args:
            self.payloads.append(type(args[0]))
        path = self.llm_kwargs[-1]["worker_extension_cls"]
        module, name = path.rsplit(".", 1)
        worker = getattr(__import__(module, fromlist=[name]), name)()
        worker.device = torch.device("cpu")
        model = types.SimpleNamespace(load_weights=lambda w: self.loaded.append(list(w)),
                                      modules=lambda: ["a layer"])
        quantization = self.llm_kwargs[-1].get("quantization")
        worker.model_runner = types.SimpleNamespace(
            get_model=lambda: model, model_config=types.SimpleNamespace(quantization=quantization))
        return [getattr(worker, method)(*args)]

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        self.seen.clear()
        return True

    def metrics(self) -> list[Any]:
        """LLM.get_metrics(): the two prefix-cache counters, one engine."""
        return [types.SimpleNamespace(name="vllm:prefix_cache_queries", value=self.cache_queries),
                types.SimpleNamespace(name="vllm:prefix_cache_hits", value=self.cache_hits)]


def _fake_module(state: FakeVLLM) -> dict[str, types.ModuleType]:
    """sys.modules entries for vllm, vllm.lora, vllm.lora.request backed by `state`."""
    vllm = types.ModuleType("vllm")

    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            state.llm_kwargs.append(kwargs)
            self.llm_engine = types.SimpleNamespace(
                reset_encoder_cache=self._encoder_reset, step=state.step,
                abort_request=state.abort, add_request=state.add_request,
                engine_core=types.SimpleNamespace(shutdown=self._shutdown))
            state.mm_cache = state.mm_cache or MultiModalProcessorSenderCache()
            self.renderer = types.SimpleNamespace(
                render_cmpl=lambda prompts: [state.render(p) for p in prompts],
                mm_processor_cache=state.mm_cache)

        def _encoder_reset(self) -> None:
            state.encoder_resets += 1

        def _shutdown(self) -> None:
            state.shutdowns += 1

        def generate(self, *args: Any, **kwargs: Any) -> list[FakeRequestOutput]:
            return state.generate(*args, **kwargs)

        def get_metrics(self) -> list[Any]:
            return state.metrics()

        def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
            return state.collective_rpc(method, args)

        def reset_prefix_cache(self) -> bool:
            return state.reset_prefix_cache()

    vllm.LLM = LLM
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda **kw: types.SimpleNamespace(**kw)
    vllm.lora, lora.request = lora, request
    kinds = types.ModuleType("vllm.sampling_params")
    kinds.RequestOutputKind = types.SimpleNamespace(FINAL_ONLY="final only")
    return {"vllm": vllm, "vllm.lora": lora, "vllm.lora.request": request,
            "vllm.sampling_params": kinds}


@pytest.fixture
def fake_vllm(tiny, monkeypatch: pytest.MonkeyPatch) -> FakeVLLM:
    """A fake `vllm` in sys.modules answering SCRIPT's words (then "stop")."""
    tok = tiny.processor.tokenizer
    fmt = chat_format(tiny.processor)
    words = [tok.encode(w, add_special_tokens=False) + [fmt.im_end] for w in SCRIPT]

    def count(pil: Any) -> int:
        return encode_image(tiny.processor, np.array(pil)).n_patches // fmt.merge**2

    state = FakeVLLM(reply_ids=lambda call: words[min(call, len(words) - 1)], image_tokens=count,
                     image_pad=fmt.image_pad)
    for name, module in _fake_module(state).items():
        monkeypatch.setitem(sys.modules, name, module)
    return state


def _vllm_session(tiny_dir: Path, workdir: Path, **settings: Any) -> Session:
    """An in-process session whose sampler engine is the vLLM engine (over the fake)."""
    return create_session(SessionSpec(str(tiny_dir), LORA, workdir=str(workdir),
                                      dtype="bfloat16",  # vLLM's LoRA kernels: bf16 / fp16
                                      engine=EngineSettings("vllm", gpu_memory_utilization=0.3,
                                                            **settings)))


@pytest.fixture
def vllm_session(fake_vllm: FakeVLLM, tiny_dir: Path, tmp_path: Path) -> Iterator[Session]:
    """An in-process session over the fake vLLM, with the default settings."""
    session = _vllm_session(tiny_dir, tmp_path / "s")
    yield session
    session.close()


def _turn_streams(tiny, turns: int = 2) -> list[Stream]:
    """A row's prompt at each of `turns` turns: system and observation, then the oracle's move
    as the reply and the next observation (a different image each turn)."""
    fmt = chat_format(tiny.processor)
    env = MazeEnv(SMALL)
    obs, info = env.reset(options={"init_state": eval_set(5, 1)[0]})
    streams = [observe(start_stream(tiny.processor, fmt, system_prompt(SMALL)), tiny.processor,
                       fmt, obs, info, SMALL)]
    for _ in range(turns - 1):
        word = format_action(oracle_actions(env.maze, env.pos)[0], SMALL.grammar)
        reply = tiny.processor.tokenizer.encode(word, add_special_tokens=False) + [fmt.im_end]
        stream = append_reply(streams[-1], fmt, reply, [-0.5] * len(reply))
        obs, _, _, _, info = env.step(word)
        streams.append(observe(stream, tiny.processor, fmt, obs, info, SMALL))
    return streams


def _two_turn_stream(tiny) -> Stream:
    """System, observation, a reply (the oracle's move), a second observation: two different
    images."""
    return _turn_streams(tiny)[-1]


# ------------------------------------------------------------------ selection


def test_vllm_missing_raises_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(ImportError) as err:
        make_engine(EngineSettings("vllm"), None, 8, tmp_path)
    msg = str(err.value)
    assert "engine.name=vllm" in msg and "pip install vllm==0.26.0" in msg
    assert "engine.name=transformers" in msg  # what to use instead on CPU


def test_config_selects_engine_with_skyrl_alias() -> None:
    assert RunConfig().engine.name == "transformers"
    assert apply_overrides(RunConfig(), ["engine.name=vllm"]).engine.name == "vllm"
    assert apply_overrides(RunConfig(), ["generator.backend=vllm"]).engine.name == "vllm"
    with pytest.raises(ConfigError, match=r"engine\.name.*'transformers', 'vllm'"):
        apply_overrides(RunConfig(), ["engine.name=sglang"])
    merged = apply_overrides(RunConfig(), ["engine.name=vllm", "engine.vllm_lora=merged"])
    assert session_spec(merged, "/tmp/w").engine.vllm_lora == "merged"
    assert RunConfig().engine.vllm_lora == "adapter"
    with pytest.raises(ConfigError, match=r"engine\.vllm_lora='merge'.*'adapter', 'merged'"):
        apply_overrides(RunConfig(), ["engine.vllm_lora=merge"])


def test_default_engine_is_transformers(tiny, tmp_path: Path) -> None:
    engine = make_engine(EngineSettings(), tiny, 8, tmp_path)
    assert isinstance(engine, TransformersEngine) and engine.name == "transformers"
    assert not engine.samples_own_weights  # it samples the model: one lane in-process
    with pytest.raises(ValueError, match="engine.name='nope'"):
        make_engine(EngineSettings("nope"), tiny, 8, tmp_path)


def test_vllm_engine_needs_lora(fake_vllm: FakeVLLM, tiny, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs LoRA"):
        make_engine(EngineSettings("vllm"), tiny, None, tmp_path)


def test_vllm_settings_come_from_the_model_or_fail_in_one_line() -> None:
    """vLLM refuses a max_model_len above the model's limit, and its LoRA kernels assert on
    float32: both are one-line errors before vLLM starts; 0 means the model's own limit, at
    most 16384 (Qwen3-VL-8B's 262,144 would need 36 GiB of KV for one request)."""
    assert checked_max_len(EngineSettings("vllm"), "bfloat16", 4096) == 4096
    assert checked_max_len(EngineSettings("vllm"), "bfloat16", 262144) == 16384
    assert checked_max_len(EngineSettings("vllm", max_model_len=65536), "bfloat16",
                           262144) == 65536
    config = apply_overrides(RunConfig(), ["engine.max_model_len=2048"])
    assert session_spec(config, "runs/x").engine.max_model_len == 2048
    assert checked_max_len(EngineSettings("vllm", max_model_len=2048), "float16", 4096) == 2048
    with pytest.raises(ValueError, match="max_model_len 8192 is above the model's "
                                         "max_position_embeddings 4096"):
        checked_max_len(EngineSettings("vllm", max_model_len=8192), "bfloat16", 4096)
    with pytest.raises(ValueError, match="not float32: set model.dtype=bfloat16"):
        checked_max_len(EngineSettings("vllm"), "float32", 4096)


def test_vllm_memory_share_is_checked_before_vllm_starts() -> None:
    gib = 2**30
    check_memory_share(0.3, free_bytes=100 * gib, total_bytes=140 * gib)  # 42 GiB of 100 free
    with pytest.raises(ValueError, match=r"engine.gpu_memory_utilization 0.5 asks vLLM for "
                       r"70.0 GiB of the GPU's 140 GiB, but only 50.0 GiB is free .*"
                       r"train\(config\) returns: close it with `.session.close\(\)`.* use 0.34 "
                       r"or less"):
        check_memory_share(0.5, free_bytes=50 * gib, total_bytes=140 * gib)
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="must be in \\(0, 1\\)"):
            check_memory_share(bad, free_bytes=140 * gib, total_bytes=140 * gib)


def test_vllm_engine_refuses_float32(fake_vllm: FakeVLLM, tiny, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="LoRA kernels take bfloat16 or float16 only"):
        make_engine(EngineSettings("vllm"), tiny, 8, tmp_path)
    assert fake_vllm.llm_kwargs == []  # refused before vLLM was started


# ------------------------------------------------------------------ requests


@pytest.mark.parametrize("types_T", [[], [0, 0], [1, 1, 1], [0, 1, 1, 0, 1, 0], [0, 1, 1],
                                     [1, 0, 0, 1, 1, 1, 1, 0]])
def test_prompt_cuts_each_image_run_to_its_first_token(types_T: list[int]) -> None:
    tokens_T = list(range(100, 100 + len(types_T)))
    kept = [tok for t, (tok, kind) in enumerate(zip(tokens_T, types_T))
            if not (kind == 1 and t > 0 and types_T[t - 1] == 1)]
    assert prompt_token_ids(Stream(tokens_T=tokens_T, mm_types_T=types_T)) == kept


def test_prompt_keeps_stream_tokens_and_images_in_order(tiny) -> None:
    stream = _two_turn_stream(tiny)
    fmt = chat_format(tiny.processor)
    assert len(stream.images) == 2
    prompt = vllm_prompt(stream)
    ids = prompt["prompt_token_ids"]
    assert ids == prompt_token_ids(stream)
    assert ids.count(fmt.image_pad) == 2  # one pad per image: vLLM expands each
    assert [t for t in ids if t != fmt.image_pad] == \
        [t for t, kind in zip(stream.tokens_T, stream.mm_types_T) if kind == 0]
    assert expand_image_pads(ids, stream.images, fmt) == stream.tokens_T  # identical tokens
    sent = prompt["multi_modal_data"]["image"]
    assert len(sent) == 2
    for pil, image in zip(sent, stream.images):
        assert np.array_equal(np.asarray(pil), image.image_HW3)
    assert not np.array_equal(np.asarray(sent[0]), np.asarray(sent[1]))  # the agent moved
    # each image's content id: vLLM's cache key instead of hashing the pixels every turn
    ids_N = prompt["multi_modal_uuids"]["image"]
    assert len(ids_N) == 2 and ids_N[0] != ids_N[1]
    same = tuple(type(i)(i.pixel_values, i.grid_thw, i.image_HW3.copy()) for i in stream.images)
    assert vllm_prompt(replace(stream, images=same))["multi_modal_uuids"]["image"] == ids_N


def test_prompt_needs_the_raw_image(tiny) -> None:
    stream = _two_turn_stream(tiny)
    bare = Stream(stream.tokens_T, stream.mm_types_T, stream.loss_mask_T, stream.logprobs_T,
                  tuple(type(i)(i.pixel_values, i.grid_thw) for i in stream.images))
    with pytest.raises(ValueError, match="image_HW3"):
        vllm_prompt(bare)


def test_prompt_mismatch_raises(tiny) -> None:
    stream = _two_turn_stream(tiny)
    check_prompt(stream.tokens_T, stream)
    ids = list(stream.tokens_T)
    k = ids.index(chat_format(tiny.processor).image_pad)
    with pytest.raises(RuntimeError, match="image processor"):  # one image token too many
        check_prompt(ids[:k] + ids[k:k + 1] + ids[k:], stream)


def test_llm_built_with_lora_prefix_caching_and_memory_share(vllm_session: Session,
                                                             fake_vllm: FakeVLLM) -> None:
    (kwargs,) = fake_vllm.llm_kwargs
    host = vllm_session.host
    assert isinstance(host.engine, VLLMEngine)
    assert kwargs["model"] == host.lm.path and kwargs["dtype"] == "bfloat16"
    assert kwargs["max_model_len"] == 4096  # the tiny model's max_position_embeddings
    assert kwargs["enable_lora"] is True and kwargs["max_lora_rank"] == 8
    assert kwargs["enable_prefix_caching"] is True
    assert kwargs["gpu_memory_utilization"] == 0.3
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["limit_mm_per_prompt"] == {"image": 16}
    assert kwargs["disable_log_stats"] is False  # the prefix-cache counters are kept
    assert [max_lora_rank(r) for r in (4, 8, 20, 32)] == [8, 8, 32, 32]


def test_closing_a_session_stops_vllm(fake_vllm: FakeVLLM, tiny_dir: Path,
                                      tmp_path: Path) -> None:
    """Session.close() stops vLLM's engine core (its process and GPU share) at once, not at
    interpreter exit: on the H200 a fourth session in one process found 11 of 140 GiB free."""
    session = create_session(SessionSpec(str(tiny_dir), LORA, workdir=str(tmp_path / "c"),
                                         dtype="bfloat16", engine=EngineSettings("vllm")))
    assert fake_vllm.shutdowns == 0
    session.close()
    assert fake_vllm.shutdowns == 1
    session.close()  # twice is fine
    assert fake_vllm.shutdowns == 1


def test_sample_sends_version_adapter_and_params(vllm_session: Session, fake_vllm: FakeVLLM,
                                                 tiny) -> None:
    fmt = chat_format(tiny.processor)
    prompt = _two_turn_stream(tiny)
    tc = vllm_session.training_client
    v0 = tc.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=3, temperature=0.7)
    got = v0.sample(prompt, 3, params, seed=5).result().sequences
    call = fake_vllm.calls[-1]
    assert [p["prompt_token_ids"] for p in call["prompts"]] == [prompt_token_ids(prompt)] * 3
    for sp in call["params"]:
        assert (sp.temperature, sp.max_tokens, sp.logprobs) == (0.7, 3, 0)
        assert sp.stop_token_ids == [fmt.im_end] and sp.detokenize is False
        assert sp.logit_bias == {t: BAN_BIAS for t in fmt.banned}
    seeds = [sp.seed for sp in call["params"]]
    assert len(set(seeds)) == 3 and all(isinstance(s, int) for s in seeds)
    folder = vllm_session.host.engine.adapter_folder(v0.version)
    lora = call["lora"]
    assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == ("v0", 1, str(folder))
    # the folder is the PEFT export vLLM loads: config + safetensors, language-model keys only
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.")
                        and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    # completions map back to our records
    right = tiny.processor.tokenizer.encode("right", add_special_tokens=False)
    expected = [fake_vllm.logprob(0, k) for k in range(len(right) + 1)]
    assert got == [Completion(right + [fmt.im_end], expected, "stop")] * 3
    # same seed, same request seeds; a new version gets its own adapter and id
    v0.sample(prompt, 3, params, seed=5).result()
    assert [sp.seed for sp in fake_vllm.calls[-1]["params"]] == seeds
    stream = append_reply(prompt, fmt, got[0].tokens, got[0].logprobs)
    tc.forward_backward([datum_from_stream(stream, 1.0)], "importance_sampling")
    tc.optim_step(AdamParams(learning_rate=1e-2)).result()
    v1 = tc.save_weights_and_get_sampling_client()
    v1.sample(prompt, 1, params).result()
    lora = fake_vllm.calls[-1]["lora"]
    assert (lora.lora_name, lora.lora_int_id) == ("v1", 2)
    assert lora.lora_path == str(vllm_session.host.engine.adapter_folder(1))
    v0.sample(prompt, 1, params).result()  # an older client still samples its own version
    assert fake_vllm.calls[-1]["lora"].lora_name == "v0"


def test_ray_sampler_engine_installs_versions_as_adapters(fake_vllm: FakeVLLM, tiny_dir: Path,
                                                         tmp_path: Path, tiny) -> None:
    """The Ray SamplerEngine actor's class (used here without Ray) with engine.name=vllm:
    a version sent by the trainer is exported and sampled by its LoRARequest."""
    from workbench.cluster.workers import SamplerEngine
    from workbench.session.host import sample, snapshot

    actor = SamplerEngine(SessionSpec(str(tiny_dir), LORA, workdir=str(tmp_path / "e"),
                                      dtype="bfloat16",
                                      engine=EngineSettings("vllm", gpu_memory_utilization=0.3)))
    assert isinstance(actor.host.engine, VLLMEngine)
    assert actor.install((3, snapshot(actor.host))) == 3
    actor.call(sample, 3, _two_turn_stream(tiny), 2, SamplingParams(max_tokens=2), 0)
    lora = fake_vllm.calls[-1]["lora"]
    assert (lora.lora_name, lora.lora_int_id) == ("v3", 4)
    assert (Path(lora.lora_path) / "adapter_model.safetensors").is_file()


def _pushed(fake_vllm: FakeVLLM, start: int) -> dict[str, torch.Tensor]:
    """The merged weights vLLM was sent from push chunk `start` on, by name."""
    return {name: t for chunk in fake_vllm.loaded[start:] for name, t in chunk}


def test_merged_lora_loads_each_version_into_vllms_weights(fake_vllm: FakeVLLM, tiny_dir: Path,
                                                           tmp_path: Path, tiny,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.vllm_lora=merged: vLLM is built without LoRA, with our worker extension. Each
    weights version reaches its weights as W + scale * B @ A under the checkpoint's own names
    (what vLLM's load_weights maps onto its fused q/k/v and gate/up) when it is first sampled,
    the prefix cache is then dropped, and requests carry no LoRARequest. An older client's
    version is merged again from its snapshot, and the model keeps the trainer's weights."""
    from safetensors.torch import load_file

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM's default: its own process
    session = create_session(SessionSpec(
        str(tiny_dir), LORA, workdir=str(tmp_path / "m"), dtype="bfloat16",
        engine=EngineSettings("vllm", gpu_memory_utilization=0.3, vllm_lora="merged")))
    try:
        kwargs = fake_vllm.llm_kwargs[-1]
        assert kwargs["worker_extension_cls"] == "workbench.vllm.merged.MergedWeightsWorker"
        assert not {"enable_lora", "max_lora_rank", "max_loras"} & kwargs.keys()
        model, tc = session.host.lm.model, session.training_client
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a non-zero B: the merged weight differs from the base
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
        v0 = tc.save_weights_and_get_sampling_client()
        assert fake_vllm.loaded == []  # merged when first sampled
        prompt, fmt = _two_turn_stream(tiny), chat_format(tiny.processor)
        [c] = v0.sample(prompt, 1, SamplingParams(max_tokens=3), seed=5).result().sequences
        assert fake_vllm.calls[-1]["lora"] is None  # no LoRA kernels: the weights are merged
        sent0 = _pushed(fake_vllm, 0)
        checkpoint = load_file(str(tiny_dir / "model.safetensors"))
        linears = {n: m for n, m in model.named_modules()
                   if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
        assert len(sent0) == len(linears) == 7 * model.config.text_config.num_hidden_layers
        for name, module in linears.items():
            key = name.removeprefix("base_model.model.") + ".weight"
            W = module.base_layer.weight.detach()
            assert torch.equal(checkpoint[key].to(W.dtype), W)  # the checkpoint's own name
            A, B = module.lora_A["default"].weight.float(), module.lora_B["default"].weight.float()
            want = W.float() + module.scaling["default"] * (B @ A)
            torch.testing.assert_close(sent0[key].float(), want, rtol=2**-8, atol=1e-6)
            assert sent0[key].dtype == torch.bfloat16 and not torch.equal(sent0[key], W)
        assert fake_vllm.resets == 1
        assert set(fake_vllm.payloads) == {bytes}  # vLLM's own process: shared (`share`)
        tc.forward_backward([datum_from_stream(append_reply(prompt, fmt, c.tokens, c.logprobs),
                                               1.0)], "importance_sampling")
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
        pushes = len(fake_vllm.loaded)
        tc.save_weights_and_get_sampling_client().sample(prompt, 1, SamplingParams()).result()
        sent1 = _pushed(fake_vllm, pushes)
        assert sent1.keys() == sent0.keys() and fake_vllm.resets == 2
        assert any(not torch.equal(sent1[k], sent0[k]) for k in sent0)  # v1's weights
        pushes = len(fake_vllm.loaded)
        v0.sample(prompt, 1, SamplingParams()).result()  # the old client: v0 merged again
        assert _pushed(fake_vllm, pushes).keys() == sent0.keys()
        assert all(torch.equal(t, sent0[k]) for k, t in _pushed(fake_vllm, pushes).items())
        assert fake_vllm.resets == 3
        assert session.host.loaded_version is None  # from v0's snapshot: the model is v1
        assert fake_vllm.encoder_resets == 0  # no LoRA on the vision tower: its features stand
    finally:
        session.close()


def test_vllm_kv_cache_set_directly_skips_vllms_start_up_measure() -> None:
    """engine.vllm_kv_cache_gb: vLLM's kv_cache_memory_bytes, in bytes; 0 leaves it to vLLM."""
    measured = engine_kwargs("m", EngineSettings("vllm"), 8, "bfloat16", 4096)
    assert "kv_cache_memory_bytes" not in measured
    direct = engine_kwargs("m", EngineSettings("vllm", vllm_kv_cache_gb=1.5), 8, "bfloat16", 4096)
    assert direct["kv_cache_memory_bytes"] == 3 * 2**29
    assert {k: v for k, v in direct.items() if k != "kv_cache_memory_bytes"} == measured


def _colocated_pair(tiny_dir: Path, workdir: Path, vllm_lora: str,
                    monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """A Ray trainer worker and the vLLM engine actor colocated with it, as the plain classes
    the actors wrap, calling each other directly (no Ray): the engine built without weights,
    as `create_ray_session` builds it when its trainer hands it every version."""
    from workbench.cluster import workers
    from workbench.cluster.ray_session import handoff_kind
    from workbench.session import ClusterSpec

    monkeypatch.setattr(workers, "remote_call",
                        lambda actor, method, *args: getattr(actor, method)(*args))
    spec = SessionSpec(str(tiny_dir), LORA, workdir=str(workdir), dtype="bfloat16",
                       engine=EngineSettings("vllm", gpu_memory_utilization=0.3,
                                             vllm_lora=vllm_lora),
                       cluster=ClusterSpec("local"))
    assert handoff_kind(spec) == vllm_lora
    trainer = workers.TrainerWorker(spec, 0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a non-zero B: the version differs from the base
        for name, p in trainer.host.lm.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return trainer, workers.SamplerEngine(spec, weights=False)


@pytest.mark.parametrize("vllm_lora", ["merged", "adapter"])
def test_a_colocated_trainer_hands_each_version_to_an_engine_without_the_model(
        fake_vllm: FakeVLLM, tiny_dir: Path, tmp_path: Path, tiny, vllm_lora: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On Ray, trainer k hands its version to the vLLM engine on its GPU, which holds no copy of
    the model (its parameters stay on the meta device): merged, the trainer's own base merged
    with the version and sent a chunk at a time as `share`d handles (by value on a CPU), the
    weights vLLM loads equal to what the in-process push sends; adapter, the version's PEFT
    folder written where the engine's vLLM reads it. The engine samples that version; an
    older one it cannot merge is refused in one line."""
    from workbench.session import host
    from workbench.vllm.merged import merged_weights

    trainer, engine = _colocated_pair(tiny_dir, tmp_path / "w", vllm_lora, monkeypatch)
    assert {p.device.type for p in engine.host.lm.model.parameters()} == {"meta"}
    version, sent = trainer.hand_version(engine, vllm_lora)
    assert engine.host.versions == {version: {}} and trainer.host.versions.keys() == {version}
    prompt = _two_turn_stream(tiny)
    engine.call(host.sample, version, prompt, 1, SamplingParams(max_tokens=3), 5)
    lora = fake_vllm.calls[-1]["lora"]
    snapshot = trainer.host.versions[version]
    if vllm_lora == "merged":
        want = {name: t for chunk in merged_weights(trainer.host.lm.model, snapshot)
                for name, t in chunk}
        got = _pushed(fake_vllm, 0)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert set(fake_vllm.payloads) == {bytes} and fake_vllm.resets == 1 and lora is None
        assert sent == sum(t.numel() * t.element_size() for t in want.values())
        trainer.host.weights_id += 1  # as an optim_step leaves it
        newer, _ = trainer.hand_version(engine, vllm_lora)
        assert engine.host.versions == {version: {}, newer: {}} and fake_vllm.resets == 2
        with pytest.raises(RuntimeError, match="sampler version 0 is not in vLLM .it holds "
                           "version 1. and this engine has nothing to merge it from"):
            engine.call(host.sample, version, prompt, 1, SamplingParams(max_tokens=3), 5)
        return
    folder = Path(engine.adapter_folder(version))
    assert lora.lora_path == str(folder) and (folder / "adapter_config.json").is_file()
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as saved:
        for name, t in snapshot.items():
            key = name.replace(".default.weight", ".weight")
            assert torch.equal(saved.get_tensor(key), t.to(torch.float32)), key
    assert sent == sum(t.numel() * t.element_size() for t in snapshot.values())


def test_fp8_vllm_reloads_each_merged_version_layer_by_layer(
        fake_vllm: FakeVLLM, tiny_dir: Path, tmp_path: Path, tiny,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """engine.vllm_fp8: vLLM is built with quantization="fp8", and a merged version's chunks load
    between vLLM's layerwise-reload calls (each layer quantised again once complete), with the
    reload's warnings about the layers a version does not carry held back and the logger's level
    restored; without vllm_fp8 no reload call is made."""
    import logging

    calls: list[str] = []
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def initialize(model: Any) -> None:
        calls.append("initialize")

    def finalize(model: Any, config: Any) -> None:
        calls.append(f"finalize at level {logging.getLevelName(log.getEffectiveLevel())}")

    reload = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload, reload.finalize_layerwise_reload = initialize, finalize
    layerwise = types.ModuleType(f"{reload.__name__}.layerwise")
    processed = types.SimpleNamespace(can_load=lambda: False, load_numel=0, load_numel_total=None)
    layerwise.get_layerwise_info = lambda module: processed  # every layer quantised again
    monkeypatch.setitem(sys.modules, reload.__name__, reload)
    monkeypatch.setitem(sys.modules, layerwise.__name__, layerwise)
    for fp8 in (False, True):
        session = create_session(SessionSpec(
            str(tiny_dir), LORA, workdir=str(tmp_path / f"q{fp8}"), dtype="bfloat16",
            engine=EngineSettings("vllm", gpu_memory_utilization=0.3, vllm_lora="merged",
                                  vllm_fp8=fp8)))
        try:
            assert fake_vllm.llm_kwargs[-1].get("quantization") == ("fp8" if fp8 else None)
            fake_vllm.rpcs.clear()
            sampler = session.training_client.save_weights_and_get_sampling_client()
            sampler.sample(_two_turn_stream(tiny), 1, SamplingParams(max_tokens=2)).result()
            chunks = len(fake_vllm.rpcs) - 2
            assert chunks >= 1 and fake_vllm.rpcs == \
                ["begin_weights"] + ["load_shared_weights"] * chunks + ["end_weights"]
        finally:
            session.close()
    assert calls == ["initialize", "finalize at level ERROR"]
    assert log.level == logging.NOTSET


def test_a_reload_that_quantised_nothing_or_part_of_a_layer_is_refused() -> None:
    """end_weights' check of vLLM's reload records: every layer either done (reset) or loaded
    in full; none done, or one with part of its weights, is a version that did not load."""
    from workbench.vllm.merged import reload_counts

    def info(done: bool, loaded: int = 0, total: int = 10) -> Any:
        return types.SimpleNamespace(can_load=lambda: not done, load_numel=loaded,
                                     load_numel_total=None if done else total)

    assert reload_counts([info(True), info(True), info(False)]) == (2, 0)  # a norm: untouched
    assert reload_counts([info(False), info(False)]) == (0, 0)
    assert reload_counts([info(True), info(False, loaded=4)]) == (1, 1)


def test_merged_vision_lora_drops_vllms_image_features(fake_vllm: FakeVLLM, tiny_dir: Path,
                                                       tmp_path: Path, tiny) -> None:
    """With LoRA on the vision tower too, a merged version changes the image features, so vLLM's
    encoder cache is dropped with its prefix cache; a vision linear's bias goes beside its merged
    weight, unchanged (vLLM's FP8 reload quantises a layer again only once it has all of it)."""
    session = create_session(SessionSpec(
        str(tiny_dir), LoraSettings(rank=8, alpha=16, vision=True), workdir=str(tmp_path / "v"),
        dtype="bfloat16",
        engine=EngineSettings("vllm", gpu_memory_utilization=0.3, vllm_lora="merged")))
    try:
        sampler = session.training_client.save_weights_and_get_sampling_client()
        sampler.sample(_two_turn_stream(tiny), 1, SamplingParams(max_tokens=2)).result()
        sent = _pushed(fake_vllm, 0)
        assert any(n.startswith("model.visual.") for n in sent)
        assert any(n.startswith("model.language_model.") for n in sent)
        assert (fake_vllm.resets, fake_vllm.encoder_resets) == (1, 1)
        biased = {n.removeprefix("base_model.model.") + ".bias": m.base_layer.bias
                  for n, m in session.host.lm.model.named_modules()
                  if hasattr(m, "lora_A") and getattr(m, "base_layer", None) is not None
                  and m.base_layer.bias is not None}
        assert biased and {n for n in sent if n.endswith(".bias")} == biased.keys()
        assert all(torch.equal(sent[n], b) for n, b in biased.items())
    finally:
        session.close()


def test_ray_sampler_engine_merges_versions_in_process(fake_vllm: FakeVLLM, tiny_dir: Path,
                                                       tmp_path: Path, tiny,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """In a Ray engine actor vLLM runs in the actor's process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
    where CUDA IPC cannot work: a merged version goes to vLLM's worker as the tensors themselves,
    and what it loads equals the trainer's merge."""
    from workbench.cluster.workers import SamplerEngine
    from workbench.model.lora import merged_weight
    from workbench.session.host import sample, snapshot

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    actor = SamplerEngine(SessionSpec(str(tiny_dir), LORA, workdir=str(tmp_path / "e"),
                                      dtype="bfloat16",
                                      engine=EngineSettings("vllm", gpu_memory_utilization=0.3,
                                                            vllm_lora="merged")))
    weights = snapshot(actor.host)
    for name, t in weights.items():  # a version whose adapter does something
        if "lora_B" in name:
            weights[name] = torch.full_like(t, 0.01)
    assert actor.install((3, weights)) == 3
    actor.call(sample, 3, _two_turn_stream(tiny), 2, SamplingParams(max_tokens=2), 0)
    sent = _pushed(fake_vllm, 0)
    model = actor.host.lm.model
    for name, module in model.named_modules():
        key = name.removeprefix("base_model.model.") + ".weight"
        if key in sent:
            assert torch.equal(sent[key], merged_weight(module))
            assert not torch.equal(sent[key], module.base_layer.weight)
    assert len(sent) == 7 * model.config.text_config.num_hidden_layers
    assert fake_vllm.payloads == [list]  # the tensors themselves, not IPC handles
    assert fake_vllm.calls[-1]["lora"] is None and fake_vllm.resets == 1


def test_vllm_session_samples_beside_the_trainer(fake_vllm: FakeVLLM, tiny_dir: Path,
                                                 tmp_path: Path, tiny,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process session over vLLM (weights of its own) runs sampling on a lane of its own:
    a rollout whose version merge waits for a forward_backward and optim_step submitted after
    it gets them (on one lane they would queue behind it and the wait would time out), and it
    samples its version's snapshot, not the weights the trainer moved meanwhile."""
    from workbench.model.lora import merged_weight
    from workbench.vllm.merged import lora_linears, snapshot_factors

    session = create_session(SessionSpec(
        str(tiny_dir), LORA, workdir=str(tmp_path / "lanes"), dtype="bfloat16",
        engine=EngineSettings("vllm", gpu_memory_utilization=0.3, vllm_lora="merged")))
    stepped = threading.Event()
    merge = fake_vllm.collective_rpc

    def merge_after_the_step(method: str, args: tuple = ()) -> list[Any]:
        assert stepped.wait(timeout=30), "the trainer's calls queued behind the rollout"
        return merge(method, args)

    monkeypatch.setattr(fake_vllm, "collective_rpc", merge_after_the_step)
    try:
        assert session.overlaps_sampling
        tc, fmt, model = session.training_client, chat_format(tiny.processor), session.host.lm.model
        v0 = tc.save_weights_and_get_sampling_client()
        snap = {k: t.clone() for k, t in session.host.versions[v0.version].items()}
        rollout = v0.play(play_episodes, SMALL, eval_set(5, 2), 2, SamplingParams(max_tokens=3),
                          0)
        reply = tiny.processor.tokenizer.encode("right", add_special_tokens=False) + [fmt.im_end]
        datum = datum_from_stream(append_reply(_two_turn_stream(tiny), fmt, reply,
                                               [-0.5] * len(reply)), 1.0)
        tc.forward_backward([datum], "importance_sampling")
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
        stepped.set()
        assert len(rollout.result(timeout=120)) == 2
        sent = _pushed(fake_vllm, 0)
        for name, module in lora_linears(model):
            v0_weight = merged_weight(module, snapshot_factors(snap, name, module))
            assert torch.equal(sent[name.removeprefix("base_model.model.") + ".weight"],
                               v0_weight)
        assert any(not torch.equal(merged_weight(m), merged_weight(m, snapshot_factors(snap, n, m)))
                   for n, m in lora_linears(model))  # the trainer's LoRA moved on
        assert session.host.loaded_version is None
    finally:
        stepped.set()
        session.close()


def test_ray_trainer_worker_starts_no_vllm(fake_vllm: FakeVLLM, tiny_dir: Path,
                                           tmp_path: Path) -> None:
    """A Ray trainer worker of a engine.name=vllm session samples nothing, so it builds no
    vLLM: on one H200 the trainer's own 0.3 share (42 GB) beside the engine actor's ran the
    8B-shape update out of memory."""
    from workbench.cluster.workers import SamplerEngine, TrainerWorker

    spec = SessionSpec(str(tiny_dir), LORA, workdir=str(tmp_path / "t"), dtype="bfloat16",
                       engine=EngineSettings("vllm", gpu_memory_utilization=0.3,
                                             vllm_lora="merged"))
    trainer = TrainerWorker(spec, 0)
    assert not isinstance(trainer.host.engine, VLLMEngine) and fake_vllm.llm_kwargs == []
    SamplerEngine(spec)
    assert len(fake_vllm.llm_kwargs) == 1  # the engine actor's


def test_completion_without_stop_is_length() -> None:
    out = FakeOutput([5, 6], [{5: types.SimpleNamespace(logprob=-1.0)},
                              {6: types.SimpleNamespace(logprob=-2.0)}], "length")
    fmt = types.SimpleNamespace(im_end=99)
    assert to_completion(out, fmt) == Completion([5, 6], [-1.0, -2.0], "length")


# ------------------------------------------------------------------ a rollout end to end


def _vllm_rollout(tiny_dir: Path, workdir: Path, seed: int = 0,
                  **settings: Any) -> list[list[Any]]:
    """2 mazes x 2 episodes of SMALL through a fresh vLLM session (over the fake)."""
    session = _vllm_session(tiny_dir, workdir, **settings)
    try:
        sampler = session.training_client.save_weights_and_get_sampling_client()
        return sampler.play(play_episodes, SMALL, eval_set(5, 2), 2, SamplingParams(max_tokens=3),
                            seed).result()
    finally:
        session.close()


def test_rollout_runs_the_multi_turn_loop_on_the_engine(fake_vllm: FakeVLLM, tiny_dir: Path,
                                                        tmp_path: Path, tiny) -> None:
    """engine.stream_rows=false: one generate a turn over every live row."""
    fmt = chat_format(tiny.processor)
    episodes_P_G = _vllm_rollout(tiny_dir, tmp_path / "s", stream_rows=False)
    assert [len(g) for g in episodes_P_G] == [2, 2]
    assert len(fake_vllm.calls) == len(SCRIPT)  # one generate per turn, all rows batched
    for call in fake_vllm.calls:
        assert len(call["prompts"]) == 4 and call["lora"].lora_name == "v0"
    for p, group in enumerate(episodes_P_G):
        for g, ep in enumerate(group):
            assert ep.replies == list(SCRIPT)
            assert ep.actions[-1].kind == "stop"
            stream = ep.stream
            assert len(stream.images) == len(SCRIPT)  # an image before each reply
            # each turn's request is the episode's stream so far (append-only, exact tokens)
            for t, call in enumerate(fake_vllm.calls):
                sent = call["prompts"][p * 2 + g]
                ids = expand_image_pads(sent["prompt_token_ids"], stream.images[:t + 1], fmt)
                assert stream.tokens_T[:len(ids)] == ids
                assert len(sent["multi_modal_data"]["image"]) == t + 1
            # sampled tokens and their log-probs are the fake's, on the trainable positions
            mask_T = stream.loss_mask_T
            replies = [fake_vllm.reply_ids(t) for t in range(len(SCRIPT))]
            assert [tok for tok, m in zip(stream.tokens_T, mask_T) if m] == sum(replies, [])
            assert ep.sampled_tokens == replies  # recorded as the engine returned them
            assert [lp for lp, m in zip(stream.logprobs_T, mask_T) if m] == pytest.approx(
                [fake_vllm.logprob(t, k) for t, reply in enumerate(replies)
                 for k in range(len(reply))])
    # every datum holds the engine's ids (the same check as the transformers engine's)
    ro = phases.RolloutRecord(episodes_P_G, SamplingParams(max_tokens=3), 0, 0.0)
    adv = phases.AdvantageRecord(np.ones((2, 2)), 0, "grpo")
    assert phases.token_mismatches(ro, adv, phases.make_datums(ro, adv)) == 0


def test_a_streamed_rollout_is_the_rollout_by_turns(fake_vllm: FakeVLLM, tiny_dir: Path,
                                                     tmp_path: Path, tiny) -> None:
    """engine.stream_rows (the default): every row's first turn is queued, and each row's next
    turn is queued as soon as its reply is back, here before other rows' first replies are
    back (the fake finishes the newest requests first). The episodes are the ones a rollout of
    one generate a turn gets: the same replies, streams, log-probs and moves, each request the
    row's stream so far; row b's turn t is seeded turn_seed(base, b, t), base the rollout's one
    draw, so the seeds do not depend on the order rows come back in."""
    by_turns = [ep for group in _vllm_rollout(tiny_dir, tmp_path / "a", 7, stream_rows=False)
                for ep in group]
    generated = len(fake_vllm.calls)
    streamed = [ep for group in _vllm_rollout(tiny_dir, tmp_path / "b", 7) for ep in group]
    assert len(fake_vllm.calls) == generated  # streamed: no generate, every request enqueued
    assert len(fake_vllm.enqueued) == len(streamed) * len(SCRIPT)
    for a, b in zip(by_turns, streamed, strict=True):
        assert (a.replies, a.positions, a.reward, a.sampled_tokens) == \
            (b.replies, b.positions, b.reward, b.sampled_tokens)
        assert (a.stream.tokens_T, a.stream.loss_mask_T, a.stream.logprobs_T) == \
            (b.stream.tokens_T, b.stream.loss_mask_T, b.stream.logprobs_T)
    order = {event: k for k, event in enumerate(fake_vllm.events)}
    first_turn = [r["id"] for r in fake_vllm.enqueued if r["turn"] == 0]
    second_turn = [r["id"] for r in fake_vllm.enqueued if r["turn"] == 1]
    assert min(order[("sent", r)] for r in second_turn) < \
        max(order[("done", r)] for r in first_turn)  # no turn waits for the whole batch
    base = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(7)))
    seeds = {turn_seed(base, row, turn): (row, turn)
             for row in range(len(streamed)) for turn in range(len(SCRIPT))}
    assert len(seeds) == len(fake_vllm.enqueued)  # one seed a row and turn, all different
    for request in fake_vllm.enqueued:
        row, turn = seeds[request["params"].seed]
        assert turn == request["turn"] and request["lora"].lora_name == "v0"
        stream = streamed[row].stream
        ids = request["prompt"]["prompt_token_ids"]  # rendered: image pads expanded
        assert stream.tokens_T[:len(ids)] == ids  # the row's stream up to its turn-t reply
        assert stream.loss_mask_T[len(ids)] == 1 and stream.loss_mask_T[len(ids) - 1] == 0


def _prefix(stream: Stream, tokens: int, images: int) -> Stream:
    """The first `tokens` tokens of a stream, with its first `images` images."""
    return Stream(stream.tokens_T[:tokens], stream.mm_types_T[:tokens],
                  stream.loss_mask_T[:tokens], stream.logprobs_T[:tokens], stream.images[:images])


def test_a_streamed_row_renders_only_each_turns_new_tokens(fake_vllm: FakeVLLM, tiny_dir: Path,
                                                           tmp_path: Path) -> None:
    """A streamed row's first request is rendered whole; each later one is its last request
    with only the turn's new tokens and image rendered: the same engine input as rendering the
    row's whole stream (tokens, content ids, placeholders), its older images sent as None (the
    engine core holds them) and each touched in the cache in order. The speed metrics count
    the requests and those rendered whole."""
    session = _vllm_session(tiny_dir, tmp_path / "s")
    try:
        sampler = session.training_client.save_weights_and_get_sampling_client()
        episodes = [ep for group in sampler.play(play_episodes, SMALL, eval_set(5, 2), 2,
                                                 SamplingParams(max_tokens=3), 0).result()
                    for ep in group]
        metrics = session.speed_metrics().result()
    finally:
        session.close()
    rows = len(episodes)
    assert (metrics["vllm/requests"], metrics["vllm/requests_rendered_whole"]) == \
        (rows * len(SCRIPT), rows)
    rendered_images = [len(r.get("multi_modal_data", {}).get("image", []))
                       for r in fake_vllm.renders]
    assert sorted(rendered_images) == [1] * rows * len(SCRIPT)  # never a whole stream again
    reference = replace(fake_vllm, renders=[], mm_cache=MultiModalProcessorSenderCache())
    for request in fake_vllm.enqueued:
        made, turn = request["prompt"], request["turn"]
        [ep] = [e for e in episodes if e.stream.tokens_T[:len(made["prompt_token_ids"])]
                == made["prompt_token_ids"] and len(e.stream) > len(made["prompt_token_ids"])][:1]
        whole = reference.render(vllm_prompt(_prefix(ep.stream, len(made["prompt_token_ids"]),
                                                     turn + 1)))
        for key in ("prompt_token_ids", "mm_hashes", "mm_placeholders"):
            assert made[key] == whole[key], key
        assert made["mm_kwargs"]["image"][:turn] == [None] * turn
    assert list(fake_vllm.mm_cache.held) == list(reference.mm_cache.held)


def test_a_prompt_that_does_not_extend_its_rows_last_is_rendered_whole(fake_vllm: FakeVLLM,
                                                                       tiny) -> None:
    """RowRequests renders a row's prompt whole when it is not its last prompt with tokens
    appended (here: the same row starts over), when vLLM's cache evicted one of the last
    request's images, and always under a processor cache it does not know (said once)."""
    first, second, third = _turn_streams(tiny, 3)
    llm = types.SimpleNamespace(renderer=types.SimpleNamespace(
        render_cmpl=lambda prompts: [fake_vllm.render(p) for p in prompts],
        mm_processor_cache=MultiModalProcessorSenderCache()))
    fake_vllm.mm_cache = llm.renderer.mm_processor_cache
    rows = RowRequests(llm, vllm_prompt)
    for stream in (first, second, first, second):
        rows.engine_input(0, stream)
    assert (rows.made, rows.whole) == (4, 2)  # first, second, first again (whole), second
    [evicted] = vllm_prompt(first)["multi_modal_uuids"]["image"]
    del fake_vllm.mm_cache.held[evicted]
    made = rows.engine_input(0, third)
    assert rows.whole == 3 and made["mm_kwargs"]["image"][0] == f"tensors of {evicted}"
    assert made["prompt_token_ids"] == third.tokens_T
    other = types.SimpleNamespace(renderer=types.SimpleNamespace(
        render_cmpl=llm.renderer.render_cmpl, mm_processor_cache=object()))
    with pytest.warns(RuntimeWarning, match="each request is rendered whole"):
        rows = RowRequests(other, vllm_prompt)
    rows.engine_input(0, first), rows.engine_input(0, second)
    assert rows.whole == 2


def test_a_rows_older_images_are_sent_as_vllms_cache_would_send_them() -> None:
    """old_items: under vLLM's IPC sender cache the engine core holds a row's older images, so
    the next request sends None for each (each touched, in order); under a front-end-only cache
    or none, each goes with the tensors the last request sent; an evicted one: render whole."""
    last = {"mm_hashes": {"image": ["a", "b"]}, "mm_kwargs": {"image": ["tensors a", None]}}

    class MultiModalProcessorOnlyCache(MultiModalProcessorSenderCache):
        pass

    sender, front = MultiModalProcessorSenderCache(), MultiModalProcessorOnlyCache()
    for cache in (sender, front):
        cache.held = {"b": None, "c": None, "a": None}
    assert old_items(sender, last) == [None, None] and list(sender.held) == ["c", "a", "b"]
    assert old_items(front, last) == ["tensors a", None] and list(front.held) == ["c", "a", "b"]
    assert old_items(None, last) == ["tensors a", None]
    del sender.held["a"]
    assert old_items(sender, last) is None and list(sender.held) == ["c", "b"]  # none touched


def test_a_failed_streamed_rollout_leaves_no_request_in_vllm(fake_vllm: FakeVLLM,
                                                             tiny_dir: Path,
                                                             tmp_path: Path) -> None:
    """A streamed rollout that fails (here vLLM counts one image token more than the stream
    holds) raises, and the rows still queued are aborted: the engine's next call does not get
    their outputs."""
    count = fake_vllm.image_tokens
    fake_vllm.image_tokens = lambda pil: count(pil) + 1
    with pytest.raises(RuntimeError, match="image processor counted different image tokens"):
        _vllm_rollout(tiny_dir, tmp_path / "f")
    assert len(fake_vllm.aborted) == 3 and fake_vllm.queue == []  # 4 rows, 1 failed


def test_prefix_cache_hits_are_reported_per_step(vllm_session: Session, fake_vllm: FakeVLLM
                                                  ) -> None:
    """Each turn resends the whole stream, so a multi-turn rollout finds most of its prompt
    tokens in the prefix cache; the session's speed metrics report vLLM's counters as the share
    since the last report (a step's)."""
    sampler = vllm_session.training_client.save_weights_and_get_sampling_client()
    sampler.play(play_episodes, SMALL, eval_set(5, 2), 2, SamplingParams(max_tokens=3),
                 0).result()
    step1 = vllm_session.speed_metrics().result()
    assert step1["vllm/prefix_cache_queried_tokens"] == fake_vllm.cache_queries > 0
    assert step1["vllm/prefix_cache_hit_rate"] == pytest.approx(
        fake_vllm.cache_hits / fake_vllm.cache_queries)
    assert step1["vllm/prefix_cache_hit_rate"] > 0.6  # 3 turns of 4 rows: most tokens reused
    assert step1["vllm/generate_s"] > 0.0  # 3 generate calls, timed
    assert vllm_session.speed_metrics().result() == {  # nothing ran since: nothing queried
        "vllm/prefix_cache_queried_tokens": 0.0, "vllm/prefix_cache_hit_rate": 0.0,
        "vllm/generate_s": 0.0, "vllm/requests": 0.0, "vllm/requests_rendered_whole": 0.0}


# ------------------------------------------------------------------ real vLLM (GPU only)


REAL_VLLM_MEMORY = {"gpu_memory_utilization": 0.05, "vllm_kv_cache_gb": 0.25}
"""A small share and a KV cache set directly: make test-gpu runs other GPU work beside these."""


def _real_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _real_vllm(), reason="needs vllm and a CUDA GPU (on the H200: vLLM 0.26.0 "
                    "from shared/gpu/gpu_site.tar.xz)")
@pytest.mark.parametrize("vllm_lora", ["adapter", "merged"])
def test_real_vllm_matches_the_trainer(tiny_dir: Path, tmp_path: Path, vllm_lora: str) -> None:
    """On a GPU with vllm: a rollout through vLLM, then the trainer re-scores the sampled tokens;
    the sampler's log-probs must agree (the request glue and the logprobs_mode are right)."""
    session = create_session(SessionSpec(str(tiny_dir), LORA, workdir=str(tmp_path / "gpu"),
                                         device="cuda", dtype="bfloat16",
                                         engine=EngineSettings("vllm", vllm_lora=vllm_lora,
                                                               **REAL_VLLM_MEMORY)))
    try:
        sampler = session.training_client.save_weights_and_get_sampling_client()
        episodes = sampler.play(play_episodes, SMALL, eval_set(5, 2), 2,
                                SamplingParams(max_tokens=3), 0).result()
        diffs = []
        for ep in (e for group in episodes for e in group):
            rescored = sampler.compute_logprobs(ep.stream).result()
            diffs += [abs(a - b) for a, b, m in
                      zip(ep.stream.logprobs_T, rescored, ep.stream.loss_mask_T) if m]
        print(f"vLLM vs trainer log-probs (bf16), {len(diffs)} reply tokens: max |diff| "
              f"{max(diffs):.3g}, median {sorted(diffs)[len(diffs) // 2]:.3g}")
        assert max(diffs) < 2e-2
    finally:
        session.close()


@pytest.mark.skipif(not _real_vllm(), reason="needs vllm and a CUDA GPU (on the H200: vLLM 0.26.0 "
                    "from shared/gpu/gpu_site.tar.xz)")
@pytest.mark.parametrize("vllm_lora", ["adapter", "merged"])
def test_real_vllm_samples_each_weight_version(tiny_dir: Path, tmp_path: Path, tiny,
                                               vllm_lora: str) -> None:
    """A step of cross-entropy on v0's own samples makes v1: the trainer's log-probs of those
    replies rise, and vLLM's next-token log-probs match the trainer's of the version each client
    pins (v1 for the new client, still v0 for the old one) within bf16 rounding: as a LoRA
    adapter, or merged into vLLM's weights (the old client's version merged again)."""
    session = create_session(SessionSpec(str(tiny_dir), LORA, workdir=str(tmp_path / "gpu"),
                                         device="cuda", dtype="bfloat16",
                                         engine=EngineSettings("vllm", vllm_lora=vllm_lora,
                                                               **REAL_VLLM_MEMORY)))
    try:
        tc, fmt = session.training_client, chat_format(tiny.processor)
        prompt = _two_turn_stream(tiny)
        v0 = tc.save_weights_and_get_sampling_client()
        seqs = v0.sample(prompt, 8, SamplingParams(max_tokens=3), seed=0).result().sequences
        streams = [append_reply(prompt, fmt, c.tokens, c.logprobs) for c in seqs]
        tc.forward_backward([datum_from_stream(st, 1.0) for st in streams], "cross_entropy")
        tc.optim_step(AdamParams(learning_rate=5e-2)).result()
        v1 = tc.save_weights_and_get_sampling_client()

        def reply_logprob(client, stream: Stream) -> float:
            return sum(lp for lp, m in zip(client.compute_logprobs(stream).result(),
                                           stream.loss_mask_T) if m)

        def vllm_gap(client, stream: Stream) -> float:
            [c] = client.sample(stream, 1, SamplingParams(max_tokens=1), seed=1).result().sequences
            full = append_reply(stream, fmt, c.tokens, c.logprobs)
            return abs(c.logprobs[0] - client.compute_logprobs(full).result()[len(stream)])

        rises = [reply_logprob(v1, st) - reply_logprob(v0, st) for st in streams]
        gaps = {name: max(vllm_gap(client, st) for st in streams)
                for name, client in (("v1", v1), ("v0", v0))}
        print(f"v1 - v0 trainer log-prob of v0's replies: min {min(rises):.3g}; vLLM vs trainer "
              f"next-token log-prob, max |diff|: {gaps}")
        assert min(rises) > 0.1, "the step did not raise the sampled replies"
        assert gaps["v1"] < 2e-2, "vLLM did not sample the v1 adapter"
        assert gaps["v0"] < 2e-2, "the older client no longer samples v0"
    finally:
        session.close()


def test_vllm_missing_names_the_key_and_what_to_use_instead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One install hint for the sampler and the endpoint, naming what asked for vLLM."""
    from workbench.vllm.args import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(ImportError, match=r"engine.name=vllm needs the vllm package .* use "
                                          r"engine.name=transformers\.$"):
        import_vllm()
