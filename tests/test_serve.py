"""The OpenAI-compatible endpoint.

Without Ray (the ASGI app in a test client, adapters in a local registry):
- a maze conversation sent as messages (image data URL + text, then the reply and the next
  observation) renders to exactly the tokens and pixels a rollout builds;
- /v1/models lists the base, every complete adapter and the promoted default;
- an unknown adapter is a 404, a broken / torn / foreign-base adapter a 422 naming the problem,
  and the server answers the next request as before; a bad image is a 400;
- the LRU keeps cache_size adapters, evicts the least recently used and reloads it unchanged;
- the API key: 401 without it or with a wrong one;
- an episode played through the endpoint (openai client, one request a turn) makes the same
  moves as the greedy in-process rollout of the same SFT model;
- the vLLM config for Ray Serve LLM (built here, deployed only where vLLM is installed).

Live (`python -m workbench serve` on Ray Serve, 2 replicas on 127.0.0.1, adapters on S3 served
by moto's server, the `openai` client):
- the base and an adapter answer the same prompt differently;
- an unknown adapter raises openai.NotFoundError;
- 50 concurrent requests over 3 adapters all succeed with a cache of 2, and the replicas'
  counters show evictions;
- a request without the key (or with another key) gets 401.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import stop_process, wait_ready

from workbench import registry, storage
from workbench.envs import MazeConfig, MazeEnv, eval_set, system_prompt
from workbench.policy import append_reply, chat_format, start_stream
from workbench.rl.rollout import observe, user_text
from workbench.serve import ServeSettings, image_data_url, key_hash, render_messages
from workbench.serve.deploy import free_port
from workbench.serve.vllm import llm_config

HAVE_SERVE = all(importlib.util.find_spec(m) for m in ("fastapi", "ray", "openai", "httpx"))
needs_serve = pytest.mark.skipif(not HAVE_SERVE, reason="needs the serve extra: ray[serve], "
                                 "fastapi, and openai / httpx for the client")
KEY = "test-key-4d2a"
MAZE = MazeConfig(size=5, max_turns=4)


def _first_turn() -> tuple[dict, dict, list[dict]]:
    env = MazeEnv(MAZE)
    obs, info = env.reset(options={"init_state": eval_set(5, 1)[0]})
    messages = [{"role": "system", "content": system_prompt(MAZE)},
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image_data_url(obs["image"])}},
                    {"type": "text", "text": user_text(obs, info, MAZE)}]}]
    return obs, info, messages


def test_messages_render_to_the_rollout_stream(tiny) -> None:
    fmt, proc = chat_format(tiny.processor), tiny.processor
    env = MazeEnv(MAZE)
    obs, info = env.reset(options={"init_state": eval_set(5, 1)[0]})
    stream = observe(start_stream(proc, fmt, system_prompt(MAZE)), proc, fmt, obs, info, MAZE)
    _, _, messages = _first_turn()
    reply = proc.tokenizer.encode("up", add_special_tokens=False) + [fmt.im_end]
    stream = append_reply(stream, fmt, reply, [0.0] * len(reply))
    obs, _, _, _, info = env.step("up")
    stream = observe(stream, proc, fmt, obs, info, MAZE)
    messages += [{"role": "assistant", "content": "up"},
                 {"role": "user", "content": [
                     {"type": "image_url", "image_url": {"url": image_data_url(obs["image"])}},
                     {"type": "text", "text": user_text(obs, info, MAZE)}]}]
    rendered = render_messages(proc, fmt, messages)
    assert rendered.tokens_T == stream.tokens_T and rendered.mm_types_T == stream.mm_types_T
    assert len(rendered.images) == 2
    for a, b in zip(rendered.images, stream.images):
        assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.grid_thw, b.grid_thw)


def test_vllm_config_matches_ray_serve_llm() -> None:
    settings = ServeSettings(model="Qwen/Qwen3-VL-8B-Instruct", served_name="qwen3vl",
                             adapters="s3://bucket/wb", cache_size=8, num_replicas=2)
    config = llm_config(settings)
    assert config["lora_config"] == {"dynamic_lora_loading_path": "s3://bucket/wb/adapters",
                                     "max_num_adapters_per_replica": 8}
    assert config["model_loading_config"] == {"model_id": "qwen3vl",
                                              "model_source": "Qwen/Qwen3-VL-8B-Instruct"}
    assert config["engine_kwargs"]["enable_lora"] and config["engine_kwargs"]["max_loras"] == 8
    with pytest.raises(ValueError, match="s3://"):
        llm_config(ServeSettings(adapters="/local/folder"))
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (the gpu extra): the config is not deployed here")
    from ray.serve.llm import LLMConfig

    assert LLMConfig(**config).lora_config.max_num_adapters_per_replica == 8


# ------------------------------------------------------------------ the app, without Ray


@pytest.fixture(scope="module")
def local_store(tmp_path_factory: pytest.TempPathFactory,
                lora_adapters: dict[str, Path]) -> storage.Store:
    """A local registry: a0 a1 a2 (a1 promoted), foreign, broken (garbage weights), torn."""
    store = storage.open_store(tmp_path_factory.mktemp("registry"))
    for name in ("a0", "a1", "a2", "foreign"):
        registry.publish(store, lora_adapters[name], name)
    registry.publish(store, lora_adapters["a0"], "broken")
    storage.write_bytes(store, "adapters/broken/adapter_model.safetensors", b"\x00garbage" * 9)
    storage.put_file(store, "adapters/torn/adapter_config.json",
                     lora_adapters["a0"] / "adapter_config.json")
    registry.promote(store, "a1")
    return store


@pytest.fixture(scope="module")
def client(local_store: storage.Store, tiny_dir: Path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from workbench.serve.app import build_app
    from workbench.serve.replica import open_replica

    settings = ServeSettings(model=str(tiny_dir), served_name="tiny", adapters=local_store.root,
                             cache_size=2, api_key_sha256=key_hash(KEY))
    engine = open_replica(settings)
    with TestClient(build_app(engine), headers={"Authorization": f"Bearer {KEY}"}) as c:
        c.engine = engine
        yield c


def _chat(client, model: str, **extra) -> tuple[int, dict]:
    _, _, messages = _first_turn()
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 4} | extra
    response = client.post("/v1/chat/completions", json=body)
    return response.status_code, response.json()


def test_models_list_the_base_adapters_and_default(client) -> None:
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["tiny", "tiny:a0", "tiny:a1", "tiny:a2", "tiny:broken", "tiny:foreign",
                   "tiny:default"]


def test_errors_are_clear_and_the_server_keeps_answering(client) -> None:
    status, body = _chat(client, "tiny:nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "'tiny:nope' does not exist" in body["error"]["message"]
    assert _chat(client, "other-model")[0] == 404
    status, body = _chat(client, "tiny:broken")
    assert status == 422 and body["error"]["code"] == "adapter_broken"
    assert "adapter 'broken' is broken" in body["error"]["message"]
    status, body = _chat(client, "tiny:torn")
    assert status == 422 and body["error"]["code"] == "adapter_incomplete"
    status, body = _chat(client, "tiny:foreign")
    assert status == 422 and body["error"]["code"] == "adapter_foreign_base"
    assert client.engine.base_hash in body["error"]["message"]
    bad_image = [{"role": "user", "content": [{"type": "image_url",
                                               "image_url": {"url": "data:image/png;base64,AAA"}}]}]
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": bad_image})
    assert response.status_code == 400 and "could not be decoded" in response.text
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": "http://example.com/x.png"}}]}]})
    assert response.status_code == 400 and "data URL" in response.text
    status, body = _chat(client, "tiny", logprobs=True)  # still serving
    assert status == 200 and body["usage"]["completion_tokens"] == len(
        body["choices"][0]["logprobs"]["content"])
    assert client.engine.counters["load_failures"] == 0  # all refused before touching the model


def test_lru_keeps_cache_size_adapters(client) -> None:
    engine = client.engine
    first = _chat(client, "tiny:a0")[1]["choices"][0]["message"]["content"]
    before = dict(engine.counters)
    for name in ("a1", "a2", "a0", "a2"):
        assert _chat(client, f"tiny:{name}")[0] == 200
    assert list(engine.resident) == ["a0", "a2"]  # least recent first
    assert engine.counters["evictions"] - before["evictions"] == 2  # a0 (by a2), a1 (by a0)
    assert engine.counters["hits"] - before["hits"] == 1  # the last a2
    assert _chat(client, "tiny:a0")[1]["choices"][0]["message"]["content"] == first
    assert _chat(client, "tiny:default")[1]["model"] == "tiny:default"  # a1, promoted
    assert "a1" in engine.resident and len(engine.resident) == 2


def test_an_episode_through_the_endpoint_is_the_greedy_rollout(sft_model: str) -> None:
    """The SFT policy plays 3 mazes through the app (openai client over the test client) and
    in-process (play_model, greedy): the same replies turn for turn."""
    from openai import OpenAI
    from starlette.testclient import TestClient

    from workbench.model import load_model
    from workbench.policy import SamplingParams
    from workbench.rl import play_model
    from workbench.serve.app import build_app
    from workbench.serve.client import play_via_endpoint
    from workbench.serve.replica import open_replica

    config, states = MazeConfig(size=5, max_turns=6), eval_set(5, 3)
    app = build_app(open_replica(ServeSettings(model=sft_model, served_name="sft")))
    client = OpenAI(base_url="http://testserver/v1", api_key="-", http_client=TestClient(app))
    reference = play_model(load_model(sft_model), config, states, 1,
                           SamplingParams(max_tokens=2, temperature=0.0))
    for state, (expected,) in zip(states, reference):
        episode = play_via_endpoint(client, "sft", config, state, max_tokens=2)
        assert episode.replies == expected.replies and episode.positions == expected.positions


def test_in_process_endpoint_serves_over_http_and_stops(local_store: storage.Store,
                                                        tiny_dir: Path) -> None:
    """address "": the same app on a uvicorn thread of this process, on a free port (port 0);
    real HTTP requests; after shutdown(endpoint) the port is free again."""
    pytest.importorskip("uvicorn")
    import httpx

    from workbench.serve import serve, shutdown

    with pytest.raises(ValueError, match="2 replicas need Ray"):
        serve(str(tiny_dir), replicas=2, address="")
    endpoint = serve(str(tiny_dir), served_name="tiny", adapters=local_store.root, port=0,
                     api_key=KEY, address="", log=lambda line: None)
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        ids = [m["id"] for m in httpx.get(f"{endpoint.base_url}/models", headers=headers)
               .json()["data"]]
        assert ids[0] == "tiny" and "tiny:a1" in ids and endpoint.num_replicas == 1
        assert httpx.get(f"{endpoint.base_url}/models").status_code == 401
    finally:
        shutdown(endpoint)
    port = int(endpoint.base_url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing listens there any more


def test_api_key_is_required(client) -> None:
    assert client.get("/v1/models", headers={"Authorization": ""}).status_code == 401
    wrong = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/stats").status_code == 200


# ------------------------------------------------------------------ live: Ray Serve


@pytest.fixture(scope="module")
def live_server(s3_server: str, lora_adapters: dict[str, Path], tiny_dir: Path, ray_temp_dir: Path,
                tmp_path_factory: pytest.TempPathFactory):
    """`python -m workbench serve` with 2 replicas on 127.0.0.1, adapters on S3 (cache 2)."""
    if not HAVE_SERVE:
        pytest.skip("needs the serve extra")
    import boto3

    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="wb-serve-live")
    store = storage.open_store("s3://wb-serve-live/wb", s3_server)
    for name in ("a0", "a1", "a2"):
        registry.publish(store, lora_adapters[name], name)
    tmp, port = tmp_path_factory.mktemp("serve"), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
        "WORKBENCH_API_KEY": KEY}
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 - closed at teardown
    cmd = [sys.executable, "-m", "workbench", "serve", "--model", str(tiny_dir), "--served-name",
           "tiny", "--adapters", store.root, "--endpoint-url", s3_server, "--replicas", "2",
           "--cache-size", "2", "--cpus-per-replica", "0.5", "--port", str(port),
           "--num-cpus", "2", "--temp-dir", str(ray_temp_dir)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_ready(proc, base_url, tmp / "serve.log", KEY, timeout_s=240, every_s=1.0)
        yield base_url
    finally:
        stop_process(proc, timeout_s=60)
        log.close()


@pytest.fixture(scope="module")
def openai_client(live_server: str):
    import openai

    return openai.OpenAI(base_url=live_server, api_key=KEY, max_retries=0, timeout=120)


@needs_serve
def test_live_base_and_adapter_answer_differently(openai_client) -> None:
    _, _, messages = _first_turn()
    ids = [m.id for m in openai_client.models.list()]
    assert ids == ["tiny", "tiny:a0", "tiny:a1", "tiny:a2"]
    answers = {}
    for model in ("tiny", "tiny:a0"):
        r = openai_client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                  max_tokens=6, seed=0)
        assert r.model == model and r.choices[0].finish_reason in ("stop", "length")
        answers[model] = r.choices[0].message.content
    assert answers["tiny"] != answers["tiny:a0"], answers


@needs_serve
def test_live_unknown_adapter_is_404(openai_client) -> None:
    import openai

    _, _, messages = _first_turn()
    with pytest.raises(openai.NotFoundError, match="'tiny:nope' does not exist"):
        openai_client.chat.completions.create(model="tiny:nope", messages=messages)


@needs_serve
def test_live_50_concurrent_requests_over_3_adapters_with_a_cache_of_2(
        openai_client, live_server: str) -> None:
    import httpx

    _, _, messages = _first_turn()
    models = [f"tiny:a{k % 3}" for k in range(50)]
    with cf.ThreadPoolExecutor(max_workers=50) as pool:
        replies = list(pool.map(lambda m: openai_client.chat.completions.create(
            model=m, messages=messages, max_tokens=4, seed=1), models))
    assert [r.model for r in replies] == models
    assert all(r.usage.completion_tokens >= 1 for r in replies)
    stats = {}
    for _ in range(30):  # requests reach either replica: collect both
        s = httpx.get(f"{live_server}/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
        stats[s["replica"]] = s
        if len(stats) == 2:
            break
    assert sum(s["evictions"] for s in stats.values()) > 0, stats
    assert all(len(s["resident"]) <= 2 and s["load_failures"] == 0 for s in stats.values())
    assert sum(s["requests"] for s in stats.values()) >= 50 or len(stats) < 2


@needs_serve
def test_live_requests_without_the_key_get_401(live_server: str) -> None:
    import httpx
    import openai

    assert httpx.get(f"{live_server}/models").status_code == 401
    wrong = openai.OpenAI(base_url=live_server, api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        wrong.models.list()
