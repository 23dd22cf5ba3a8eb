"""The serving app's vLLM backend (`ServeSettings.engine="vllm"`, workbench.serve.vllm_async).

vLLM cannot run here (no CUDA), so apart from the last test (skipped unless vllm imports and CUDA
is available) these tests put a FAKE async `vllm` module into sys.modules, as
tests/test_vllm_engine.py does for the sampler. It records what the app asks of it and answers
the way vLLM's AsyncLLM does: `generate` is an async generator of cumulative RequestOutputs whose
`prompt_token_ids` have each <|image_pad|> expanded to its image's token count, the last one
holding outputs[0].token_ids and .logprobs. Each adapter (and the base) answers its own word, so
a reply shows which LoRARequest reached the engine.

Pinned: the engine's arguments (LoRA with max_loras = cache_size, prefix caching, memory share,
the model's context length), each adapter's LoRARequest (name, stable id, folder), the LRU
counters, requests as token prompts + images + sampling params, OpenAI-shaped JSON, 404 / 400 /
422 refusals that never reach the engine, and that concurrent HTTP requests (the real `openai`
client against the in-process uvicorn endpoint) are all inside the engine at once.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from workbench import registry, storage
from workbench.envs import MazeConfig, MazeEnv, eval_set, system_prompt
from workbench.policy import chat_format, encode_image
from workbench.rl.rollout import user_text
from workbench.serve import ServeSettings, image_data_url, render_messages
from workbench.vllm.engine import BAN_BIAS, prompt_token_ids, row_seeds

MAZE = MazeConfig(size=5, max_turns=4)
WORDS = {None: "up", "a0": "left", "a1": "right", "a2": "down"}  # the fake's reply per adapter
ADAPTERS = ("a0", "a1", "a2")


def _messages(images: int = 1) -> list[dict[str, Any]]:
    """A maze's first turn: the system rules, then `images` copies of the observation and the
    rollout's text."""
    env = MazeEnv(MAZE)
    obs, info = env.reset(options={"init_state": eval_set(5, 1)[0]})
    image = {"type": "image_url", "image_url": {"url": image_data_url(obs["image"])}}
    return [{"role": "system", "content": system_prompt(MAZE)},
            {"role": "user", "content": [image] * images
             + [{"type": "text", "text": user_text(obs, info, MAZE)}]}]


# ------------------------------------------------------------------ the fake async vllm module


@dataclass
class FakeOutput:
    """vllm.CompletionOutput's fields we read."""

    token_ids: list[int]
    logprobs: list[dict[int, Any]]


@dataclass
class FakeRequestOutput:
    """vllm.RequestOutput's fields we read."""

    prompt_token_ids: list[int]
    outputs: list[FakeOutput]
    finished: bool


@dataclass
class FakeAsyncVLLM:
    """State of the fake: engine arguments, every generate() call, and how to answer."""

    reply_ids: Callable[[Any], list[int]]  # LoRARequest (None: the base) -> reply token ids
    image_tokens: Callable[[Any], int]  # PIL image -> token count (vLLM runs the HF processor)
    image_pad: int  # each <|image_pad|> in a prompt is expanded to its image's tokens
    engine_args: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    barrier: int = 0  # hold each request until this many are in flight at once (0: never)
    in_flight: int = 0
    peak: int = 0  # most requests in flight at once
    shutdowns: int = 0
    released: asyncio.Event | None = None

    @staticmethod
    def logprob(position: int) -> float:
        return -0.25 - 0.125 * position

    def expand(self, prompt: dict[str, Any]) -> list[int]:
        images = iter(prompt.get("multi_modal_data", {}).get("image", []))
        return [t for tok in prompt["prompt_token_ids"]
                for t in ([tok] * self.image_tokens(next(images)) if tok == self.image_pad
                          else [tok])]

    async def hold(self) -> None:
        """Wait until `barrier` requests are in flight together (a serialised server never gets
        there: the first request would wait alone, and fail after 60 s)."""
        if self.released is None:
            self.released = asyncio.Event()
        if self.in_flight >= self.barrier:
            self.released.set()
        await asyncio.wait_for(self.released.wait(), timeout=60)

    async def generate(self, prompt: dict[str, Any], sampling_params: Any, request_id: str, *,
                       lora_request: Any = None) -> Any:
        """AsyncLLM.generate: record the call, then yield a first token and the finished
        reply (the adapter's word), each with the expanded prompt."""
        self.calls.append(dict(prompt=prompt, params=sampling_params, request_id=request_id,
                               lora=lora_request))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if self.barrier:
                await self.hold()
            reply = self.reply_ids(lora_request)
            logprobs = [{tok: types.SimpleNamespace(logprob=self.logprob(k))}
                        for k, tok in enumerate(reply)]
            for k in (1, len(reply)):  # cumulative outputs, the last one finished
                yield FakeRequestOutput(self.expand(prompt),
                                        [FakeOutput(reply[:k], logprobs[:k])], k == len(reply))
        finally:
            self.in_flight -= 1


def _fake_module(state: FakeAsyncVLLM) -> dict[str, types.ModuleType]:
    """sys.modules entries for vllm, vllm.lora, vllm.lora.request backed by `state`."""
    vllm = types.ModuleType("vllm")

    class AsyncEngineArgs:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs

    class AsyncLLMEngine:
        @classmethod
        def from_engine_args(cls, args: AsyncEngineArgs) -> AsyncLLMEngine:
            state.engine_args.append(args.kwargs)
            return cls()

        def generate(self, *args: Any, **kwargs: Any) -> Any:
            return state.generate(*args, **kwargs)

        def shutdown(self) -> None:
            state.shutdowns += 1

    vllm.AsyncEngineArgs, vllm.AsyncLLMEngine = AsyncEngineArgs, AsyncLLMEngine
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda **kw: types.SimpleNamespace(**kw)
    vllm.lora, lora.request = lora, request
    return {"vllm": vllm, "vllm.lora": lora, "vllm.lora.request": request}


@pytest.fixture
def fake_vllm(tiny, monkeypatch: pytest.MonkeyPatch) -> FakeAsyncVLLM:
    """A fake async `vllm` in sys.modules: the base answers "up", adapter aK its WORDS word."""
    tok, fmt = tiny.processor.tokenizer, chat_format(tiny.processor)

    def reply(lora: Any) -> list[int]:
        word = WORDS[None if lora is None else lora.lora_name]
        return tok.encode(word, add_special_tokens=False) + [fmt.im_end]

    def count(pil: Any) -> int:
        return encode_image(tiny.processor, np.array(pil)).n_patches // fmt.merge**2

    state = FakeAsyncVLLM(reply_ids=reply, image_tokens=count, image_pad=fmt.image_pad)
    for name, module in _fake_module(state).items():
        monkeypatch.setitem(sys.modules, name, module)
    return state


@pytest.fixture
def store(tmp_path: Path, lora_adapters: dict[str, Path]) -> storage.Store:
    """A local registry with a0, a1, a2 (LoRA r4 on the tiny base)."""
    store = storage.open_store(tmp_path / "registry")
    for name in ADAPTERS:
        registry.publish(store, lora_adapters[name], name)
    return store


def _settings(tiny_dir: Path, store: storage.Store, **extra: Any) -> ServeSettings:
    return ServeSettings(model=str(tiny_dir), served_name="tiny", adapters=store.root,
                         cache_size=2, engine="vllm", gpu_memory_utilization=0.3,
                         cache_dir=str(Path(store.root).parent / "cache"), **extra)


@pytest.fixture
def client(fake_vllm: FakeAsyncVLLM, store: storage.Store, tiny_dir: Path) -> Iterator[Any]:
    """The app over a vllm engine (on the fake), in starlette's test client; `client.engine`."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from workbench.serve.app import build_app
    from workbench.serve.engine import close_engine
    from workbench.serve.replica import open_replica

    engine = open_replica(_settings(tiny_dir, store))
    with TestClient(build_app(engine)) as c:
        c.engine = engine
        yield c
    close_engine(engine)


def _chat(client: Any, model: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "messages": _messages(), "temperature": 0, "max_tokens": 4} | extra
    response = client.post("/v1/chat/completions", json=body)
    return response.status_code, response.json()


def _word(body: dict[str, Any], choice: int = 0) -> str:
    return body["choices"][choice]["message"]["content"]


# ------------------------------------------------------------------ the engine


def test_engine_choice_is_checked_in_one_line() -> None:
    assert ServeSettings().engine == "transformers"
    with pytest.raises(ValueError, match=r"^serve engine 'sglang' is not one of "
                                         r"'transformers', 'vllm'$"):
        ServeSettings(engine="sglang")


def test_vllm_missing_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                           tiny_dir: Path) -> None:
    from workbench.serve.replica import open_replica

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(ImportError) as err:
        open_replica(ServeSettings(model=str(tiny_dir), engine="vllm"))
    message = str(err.value)
    assert "\n" not in message and "engine='vllm' needs the vllm package" in message
    assert "pip install 'workbench[gpu]'" in message and "engine='transformers'" in message


def test_cli_plumbs_the_engine_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m workbench serve --engine vllm ...` starts the endpoint with those settings on
    CUDA, then stops that endpoint (its server and vLLM) when interrupted."""
    import signal
    import time

    from workbench import cli
    from workbench.serve import deploy

    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(deploy, "start", lambda settings, *rest: calls.append(
        ("start", (settings, *rest))) or "the endpoint")
    monkeypatch.setattr(deploy, "shutdown", lambda endpoint, disconnect: calls.append(
        ("shutdown", (endpoint, disconnect))))
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt))
    cli.main(["serve", "--engine", "vllm", "--model", "m", "--adapters", "store", "--address",
              "", "--gpu-memory-utilization", "0.4", "--dtype", "bfloat16", "--port", "0"])
    (_, (settings, address, num_cpus, temp_dir)), stop = calls
    assert (settings.engine, settings.device, settings.gpu_memory_utilization, settings.dtype,
            settings.model, settings.adapters) == ("vllm", "cuda", 0.4, "bfloat16", "m", "store")
    assert address == "" and stop == ("shutdown", ("the endpoint", True))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--engine", "sglang"])


def test_engine_is_built_with_lora_slots_prefix_caching_and_memory_share(
        client: Any, fake_vllm: FakeAsyncVLLM, tiny_dir: Path) -> None:
    from workbench.model import load_model, weights_hash

    engine = client.engine
    (kwargs,) = fake_vllm.engine_args
    assert kwargs == {
        "model": engine.lm.path, "tokenizer": engine.lm.path, "dtype": "bfloat16", "seed": 0,
        "gpu_memory_utilization": 0.3, "enable_prefix_caching": True, "enable_lora": True,
        "max_lora_rank": 8,  # the adapters are r4; vLLM's smallest slot rank that holds 4 is 8
        "max_loras": 2, "max_cpu_loras": 2,  # cache_size
        "max_model_len": 4096,  # the tiny model's max_position_embeddings
        "limit_mm_per_prompt": {"image": 16}, "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True}
    assert engine.lm.path == str(tiny_dir) and engine.lm.model is None  # vLLM holds the weights
    assert engine.base_hash == weights_hash(load_model(str(tiny_dir)).model)  # float32, as trained


def test_each_adapter_goes_as_its_lora_request_and_the_lru_counts(
        client: Any, fake_vllm: FakeAsyncVLLM, store: storage.Store) -> None:
    """cache_size 2: a0 a1 a2 miss (a2 evicts a0), the base needs no adapter, a0 misses again
    (evicts a1) and keeps its id, a2 hits."""
    models = ["tiny:a0", "tiny:a1", "tiny:a2", "tiny", "tiny:a0", "tiny:a2"]
    replies = [_chat(client, model) for model in models]
    assert [status for status, _ in replies] == [200] * 6
    assert [_word(body) for _, body in replies] == ["left", "right", "down", "up", "left", "down"]
    assert [body["model"] for _, body in replies] == models
    folder = {name: str(Path(store.root) / registry.ADAPTERS / name) for name in ADAPTERS}
    sent = [call["lora"] for call in fake_vllm.calls]
    assert [None if lora is None else (lora.lora_name, lora.lora_int_id, lora.lora_path)
            for lora in sent] == [("a0", 1, folder["a0"]), ("a1", 2, folder["a1"]),
                                  ("a2", 3, folder["a2"]), None, ("a0", 1, folder["a0"]),
                                  ("a2", 3, folder["a2"])]
    stats = client.get("/v1/stats").json()
    assert {k: stats[k] for k in ("requests", "hits", "misses", "evictions", "fetches",
                                  "load_failures")} == {
        "requests": 6, "hits": 1, "misses": 4, "evictions": 2, "fetches": 4, "load_failures": 0}
    assert stats["resident"] == ["a0", "a2"] and stats["cache_size"] == 2


def test_a_request_goes_as_token_prompt_images_and_sampling_params(
        client: Any, fake_vllm: FakeAsyncVLLM, tiny) -> None:
    """n=2: two vLLM requests with the stream's tokens (one pad per image) and PIL image, the
    sampler's params, seeds drawn from the request's seed; back comes OpenAI's JSON."""
    fmt, tok = chat_format(tiny.processor), tiny.processor.tokenizer
    status, body = _chat(client, "tiny:a1", n=2, seed=3, temperature=0.5, max_tokens=5,
                         logprobs=True)
    assert status == 200
    stream = render_messages(tiny.processor, fmt, _messages())
    assert len(fake_vllm.calls) == 2
    for call, seed in zip(fake_vllm.calls, row_seeds(2, torch.Generator().manual_seed(3))):
        assert call["prompt"]["prompt_token_ids"] == prompt_token_ids(stream)
        (pil,) = call["prompt"]["multi_modal_data"]["image"]
        assert np.array_equal(np.asarray(pil), stream.images[0].image_HW3)
        params = call["params"]
        assert (params.temperature, params.max_tokens, params.logprobs, params.seed) == \
            (0.5, 5, 0, seed)
        assert params.stop_token_ids == [fmt.im_end] and params.detokenize is False
        assert params.logit_bias == {t: BAN_BIAS for t in fmt.banned}
    reply = tok.encode("right", add_special_tokens=False) + [fmt.im_end]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny:a1"
    assert body["usage"] == {"prompt_tokens": len(stream), "completion_tokens": 2 * len(reply),
                             "total_tokens": len(stream) + 2 * len(reply)}
    for i, choice in enumerate(body["choices"]):
        assert choice["index"] == i and choice["finish_reason"] == "stop"
        assert choice["message"] == {"role": "assistant", "content": "right"}
        assert [(t["token"], t["logprob"], bytes(t["bytes"]))
                for t in choice["logprobs"]["content"]] == [
            (tok.decode([t]), fake_vllm.logprob(k), tok.decode([t]).encode())
            for k, t in enumerate(reply)]  # "right" is one token; <|im_end|> its own text


def test_refused_requests_never_reach_the_engine(client: Any, fake_vllm: FakeAsyncVLLM,
                                                 store: storage.Store,
                                                 lora_adapters: dict[str, Path],
                                                 tmp_path: Path) -> None:
    status, body = _chat(client, "tiny:nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "'tiny:nope' does not exist" in body["error"]["message"]
    response = client.post("/v1/chat/completions", json={"model": "tiny",
                                                         "messages": _messages(images=17)})
    assert response.status_code == 400
    assert "holds 17 images: this server takes at most 16" in response.json()["error"]["message"]
    wide = tmp_path / "wide"  # a0 re-labelled r64, published after the engine started
    shutil.copytree(lora_adapters["a0"], wide)
    config = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps(config | {"r": 64}))
    registry.publish(store, wide, "wide", eval_results={})
    status, body = _chat(client, "tiny:wide")
    assert status == 422 and body["error"]["code"] == "adapter_rank"
    assert "LoRA rank 64, above this server's max_lora_rank 8" in body["error"]["message"]
    assert fake_vllm.calls == [] and "wide" not in client.engine.resident


def test_a_vision_lora_adapter_is_refused_by_vllm_and_served_by_transformers(
        client: Any, fake_vllm: FakeAsyncVLLM, store: storage.Store, tiny_dir: Path,
        tmp_path: Path) -> None:
    """vLLM applies LoRA to Qwen3-VL's language model only: an adapter with vision-tower LoRA
    (lora.vision=true) is a 422 naming its modules and the fix; transformers serves it."""
    from conftest import export_adapter
    from starlette.testclient import TestClient

    from workbench.model import LoraSettings
    from workbench.serve.app import build_app
    from workbench.serve.engine import open_transformers_replica
    from workbench.serve.vllm_async import vision_modules

    folder = export_adapter(tiny_dir, tmp_path / "vis", LoraSettings(4, 8, vision=True), 7)
    registry.publish(store, folder, "vis", eval_results={})
    modules = vision_modules(folder)
    assert modules[:3] == ["visual.blocks.0.attn.proj", "visual.blocks.0.attn.qkv",
                           "visual.blocks.0.mlp.linear_fc1"]
    status, body = _chat(client, "tiny:vis")
    assert status == 422 and body["error"]["code"] == "adapter_vision_lora"
    assert body["error"]["message"] == (
        "adapter 'vis' has LoRA on vision-tower modules (visual.blocks.0.attn.proj, "
        "visual.blocks.0.attn.qkv, visual.blocks.0.mlp.linear_fc1, ... "
        f"({len(modules)} in all)) that vLLM does not apply on Qwen3-VL: train it with "
        "lora.vision=false, or serve it with engine='transformers'")
    assert fake_vllm.calls == [] and "vis" not in client.engine.resident
    assert vision_modules(Path(store.root) / "adapters" / "a0") == []  # language-only
    assert _chat(client, "tiny:a0")[0] == 200
    engine = open_transformers_replica(ServeSettings(model=str(tiny_dir), served_name="tiny",
                                                    adapters=store.root))
    with TestClient(build_app(engine)) as plain:
        status, body = _chat(plain, "tiny:vis")
    assert status == 200 and list(engine.resident) == ["vis"]


def test_past_max_queue_429_and_past_the_time_504_with_the_request_cancelled(
        fake_vllm: FakeAsyncVLLM, store: storage.Store, tiny_dir: Path) -> None:
    """max_queue 1, request_timeout_s 1: the fake holds a request (it waits for a second one
    in flight, which never comes); meanwhile another gets 429 with Retry-After; the held one
    gets 504 and its vLLM request is cancelled (out of the engine); then the server answers."""
    import concurrent.futures as cf
    import time

    from starlette.testclient import TestClient

    from workbench.serve.app import build_app
    from workbench.serve.engine import close_engine
    from workbench.serve.replica import open_replica

    engine = open_replica(_settings(tiny_dir, store, max_queue=1, request_timeout_s=1.0))
    body = {"model": "tiny:a0", "messages": _messages(), "max_tokens": 4}
    fake_vllm.barrier = 2
    with TestClient(build_app(engine)) as client, cf.ThreadPoolExecutor(1) as pool:
        held = pool.submit(client.post, "/v1/chat/completions", json=body)
        while fake_vllm.in_flight < 1:
            time.sleep(0.005)
        refused = client.post("/v1/chat/completions", json=body)
        assert not held.done()
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        response = held.result()
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        assert fake_vllm.in_flight == 0 and len(fake_vllm.calls) == 1
        fake_vllm.barrier = 0
        status, reply = _chat(client, "tiny:a0")
        assert status == 200 and _word(reply) == "left"
    close_engine(engine)


# ------------------------------------------------------------------ over HTTP, concurrently


def test_concurrent_requests_are_all_in_the_engine_at_once(fake_vllm: FakeAsyncVLLM,
                                                           store: storage.Store,
                                                           tiny_dir: Path) -> None:
    """9 requests over 3 adapters from openai.AsyncOpenAI to the in-process uvicorn endpoint:
    the fake holds each until all 9 are inside generate(), so they pass only if the app awaits
    the engine without serialising requests; then an unknown adapter is openai's 404."""
    pytest.importorskip("uvicorn")
    import openai

    from workbench.serve import serve, shutdown

    fake_vllm.barrier = 9
    endpoint = serve(str(tiny_dir), served_name="tiny", adapters=store.root, port=0, address="",
                     engine="vllm", cache_size=3, gpu_memory_utilization=0.3,
                     cache_dir=str(Path(store.root).parent / "cache"), log=lambda line: None)
    models = [f"tiny:{ADAPTERS[k % 3]}" for k in range(9)]

    async def ask_all() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="-",
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(client.chat.completions.create(
                model=model, messages=_messages(), max_tokens=4) for model in models))

    try:
        replies = asyncio.run(ask_all())
        assert fake_vllm.peak == 9 and fake_vllm.in_flight == 0
        assert [r.model for r in replies] == models
        assert [r.choices[0].message.content for r in replies] == \
            [WORDS[m.split(":")[1]] for m in models]
        sync = openai.OpenAI(base_url=endpoint.base_url, api_key="-", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="'tiny:nope' does not exist"):
            sync.chat.completions.create(model="tiny:nope", messages=_messages())
    finally:
        shutdown(endpoint)
    assert fake_vllm.shutdowns == 1  # stopping the endpoint stops vLLM's engine


# ------------------------------------------------------------------ real vLLM (GPU only)


def _real_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def _streamed(client: Any, model: str, **extra: Any) -> list[dict[str, Any]]:
    """The chunks of a streamed request (SSE `data:` events up to [DONE])."""
    body = {"model": model, "messages": _messages(), "temperature": 0, "max_tokens": 4,
            "stream": True} | extra
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_failed_choice_cancels_the_others_and_its_error_is_raised() -> None:
    """A request's n choices run together (`all_or_none`): when one fails, the others are
    cancelled at once (vLLM aborts a cancelled request) and the first error is what is raised."""
    from workbench.serve.vllm_async import all_or_none

    cancelled = []

    async def waits(name: str) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("choice 1 failed")

    async def run() -> list[str]:
        with pytest.raises(ValueError, match="choice 1 failed"):
            await asyncio.wait_for(all_or_none([waits("a"), fails(), waits("b")]), timeout=30)
        await asyncio.sleep(0.1)  # a choice still running would be sleeping now
        return sorted(cancelled)

    assert asyncio.run(run()) == ["a", "b"]


def test_a_streamed_reply_through_vllm_is_the_unstreamed_one(client: Any,
                                                              fake_vllm: FakeAsyncVLLM) -> None:
    """Each choice's chunks: the role, a token a chunk as vLLM's outputs grow (the fake yields
    one token, then the rest), the finish reason; text, log-probs and usage as unstreamed."""
    ask = dict(n=2, seed=3, temperature=0.5, logprobs=True)
    status, whole = _chat(client, "tiny:a1", **ask)
    assert status == 200
    chunks = _streamed(client, "tiny:a1", stream_options={"include_usage": True}, **ask)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    for i, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == \
            choice["message"]["content"] == "right"
        assert [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]] == \
            choice["logprobs"]["content"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"] == "stop"
    seeds = [call["params"].seed for call in fake_vllm.calls]
    assert seeds[:2] == seeds[2:]  # the same seeds, drawn from the request's


@pytest.mark.gpu
@pytest.mark.skipif(not _real_vllm(), reason="needs vllm and a CUDA GPU (on the H200: vLLM 0.26.0 "
                    "from shared/gpu/gpu_site.tar.xz)")
def test_real_vllm_serves_three_adapters_that_differ_from_the_base(store: storage.Store,
                                                                   tiny_dir: Path) -> None:
    """The tiny model through vLLM's async engine, 3 adapters: greedy replies (tokens and
    log-probs) of each adapter differ from the base's, each streamed the same as unstreamed,
    and all 3 were loaded once."""
    import urllib.request

    import openai

    from workbench.serve import serve, shutdown

    endpoint = serve(str(tiny_dir), served_name="tiny", adapters=store.root, port=0, address="",
                     engine="vllm", cache_size=3, gpu_memory_utilization=0.05,
                     kv_cache_gb=0.25, cache_dir=str(Path(store.root).parent / "cache"))
    try:
        client = openai.OpenAI(base_url=endpoint.base_url, api_key="-", max_retries=0,
                               timeout=300)
        replies = {}
        for model in ("tiny", *(f"tiny:{name}" for name in ADAPTERS)):
            r = client.chat.completions.create(model=model, messages=_messages(), max_tokens=8,
                                               temperature=0, logprobs=True)
            replies[model] = [(t.token, round(t.logprob, 3)) for t in r.choices[0].logprobs.content]
            chunks = list(client.chat.completions.create(
                model=model, messages=_messages(), max_tokens=8, temperature=0, logprobs=True,
                stream=True))
            streamed = [(t.token, round(t.logprob, 3)) for c in chunks if c.choices[0].logprobs
                        for t in c.choices[0].logprobs.content]
            assert streamed == replies[model]  # the same reply, streamed by vLLM
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
                r.choices[0].message.content
        with urllib.request.urlopen(f"{endpoint.base_url}/stats") as response:
            stats = json.loads(response.read())
    finally:
        shutdown(endpoint)
    print({model: reply[:3] for model, reply in replies.items()})
    assert all(replies[f"tiny:{name}"] != replies["tiny"] for name in ADAPTERS), replies
    assert (stats["misses"], stats["evictions"], stats["load_failures"]) == (3, 0, 0)
