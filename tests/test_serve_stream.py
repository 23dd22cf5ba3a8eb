"""Streamed replies (`"stream": true`, `workbench.serve.stream`) over real HTTP: the endpoint on
uvicorn in this process (`serve(..., address="")`, the transformers engine on the tiny model,
adapter a0 in a local registry), read by the official `openai` client and by raw httpx:
- a streamed reply is the unstreamed one in chunks: the same text, log-probs, finish reasons
  and usage for each of n choices, a role chunk first for each, `[DONE]` last;
- an error before the prompt is rendered is the request's HTTP error (404, 400);
- a client that leaves mid-stream frees its place at once: the decode stops (far fewer tokens
  than asked) and the next request is served;
- hostile streams: a client that reads nothing is cut at request_timeout_s, and a hundred
  streams opened and dropped (before or after their first chunk) leave the server holding
  nothing and answering.
The same through the vLLM engine is in tests/test_serve_vllm.py (a fake vLLM on the CPU; the
real one on the GPU).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from workbench import registry, storage
from workbench.envs import MazeConfig, eval_set
from workbench.serve.client import first_messages

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

KEY = "stream-key-3d9a"
MAZE = MazeConfig(size=5, max_turns=4)
LONG = 2048  # max_tokens of a reply that decodes for many seconds on the tiny model


@pytest.fixture(scope="module")
def stream_store(tmp_path_factory: pytest.TempPathFactory,
                 lora_adapters: dict[str, Path]) -> str:
    store = storage.open_store(tmp_path_factory.mktemp("stream-registry"))
    registry.publish(store, lora_adapters["a0"], "a0")
    return store.root


def _serve(tiny_dir: Path, store: str, **limits: Any) -> Any:
    from workbench.serve import serve

    return serve(str(tiny_dir), adapters=store, served_name="tiny", port=0, api_key=KEY,
                 address="", max_tokens_limit=LONG, log=lambda line: None, **limits)


@pytest.fixture(scope="module")
def endpoint(tiny_dir: Path, stream_store: str) -> Iterator[Any]:
    from workbench.serve import shutdown

    endpoint = _serve(tiny_dir, stream_store, max_queue=4, request_timeout_s=60.0)
    try:
        yield endpoint
    finally:
        shutdown(endpoint)


def _maze_messages() -> list[dict[str, Any]]:
    return first_messages(MAZE, eval_set(5, 1)[0])


def _stats(client: Any, endpoint: Any) -> dict[str, Any]:
    return client.get(f"{endpoint.base_url}/stats").json()


def _until_nothing_held(client: Any, endpoint: Any) -> dict[str, Any]:
    """/v1/stats once the server holds no request (fails after 60 s)."""
    deadline = time.monotonic() + 60
    while (stats := _stats(client, endpoint))["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats["in_flight"] == 0, stats
    return stats


def _completion_tokens(client: Any, endpoint: Any) -> float:
    text = client.get(endpoint.base_url.removesuffix("/v1") + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("workbench_serve_completion_tokens_total{"))


@pytest.mark.parametrize("model", ["tiny", "tiny:a0"])
def test_a_streamed_reply_is_the_unstreamed_one_in_chunks(endpoint: Any, model: str) -> None:
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=KEY)
    ask = dict(model=model, messages=_maze_messages(), n=3, seed=7, max_tokens=12,
               temperature=1.0, logprobs=True)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True,
                                                 stream_options={"include_usage": True}))
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == \
        "chat.completion.chunk"
    assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3  # role first
    assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
    *body, last = chunks
    assert last.choices == [] and last.usage == whole.usage  # the usage chunk, last
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        entries = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert [(e.token, e.logprob, e.bytes) for e in entries] == \
            [(e.token, e.logprob, e.bytes) for e in choice.logprobs.content]
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        assert mine[-1].finish_reason == choice.finish_reason  # the choice's last chunk
    assert sum(len(c.message.content or "") for c in whole.choices) > 0  # a reply was made


def test_a_stream_ends_with_done_and_without_usage_unless_asked(endpoint: Any) -> None:
    body = {"model": "tiny", "messages": _maze_messages(), "max_tokens": 3, "seed": 1,
            "stream": True}
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        response = client.post(f"{endpoint.base_url}/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)  # no usage chunk
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)  # not asked
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_an_error_before_the_prompt_is_rendered_is_the_requests_status(endpoint: Any) -> None:
    client = openai.OpenAI(base_url=endpoint.base_url, api_key=KEY)
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.chat.completions.create(model="tiny:nope", messages=_maze_messages(),
                                       stream=True)
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed"):
        client.chat.completions.create(model="tiny", messages=_maze_messages(),
                                       stream_options={"include_usage": True})
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "up " * 5000}], stream=True)


def _long_stream(model: str = "tiny") -> dict[str, Any]:
    return {"model": model, "messages": _maze_messages(), "max_tokens": LONG, "n": 16,
            "temperature": 1.0, "seed": 2, "stream": True}


def test_a_client_that_leaves_mid_stream_frees_its_place_at_once(endpoint: Any) -> None:
    url = f"{endpoint.base_url}/chat/completions"
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        before = _completion_tokens(client, endpoint)
        with client.stream("POST", url, json=_long_stream()) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # the first chunk came; then we leave
        _until_nothing_held(client, endpoint)
        sent = _completion_tokens(client, endpoint) - before
        assert 0 <= sent < 16 * LONG  # the decode stopped long before its end
        again = client.post(url, json={"model": "tiny", "messages": _maze_messages(),
                                       "max_tokens": 2})
        assert again.status_code == 200


def _raw_request(endpoint: Any, body: dict[str, Any]) -> socket.socket:
    """A connection that sent a streamed request (and reads nothing unless told)."""
    data = json.dumps(body).encode()
    port = int(endpoint.base_url.rsplit(":", 1)[1].split("/")[0])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def test_a_client_that_reads_nothing_is_cut_at_the_request_timeout(
        tiny_dir: Path, stream_store: str) -> None:
    from workbench.serve import shutdown

    endpoint = _serve(tiny_dir, stream_store, max_queue=1, request_timeout_s=2.0)
    try:
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
            silent = _raw_request(endpoint, _long_stream())
            try:
                while not _stats(client, endpoint)["in_flight"]:
                    time.sleep(0.01)
                stats = _until_nothing_held(client, endpoint)  # cut at 2 s, not at its end
                assert stats["refused_queue_full"] == 0
                ok = client.post(f"{endpoint.base_url}/chat/completions", json={
                    "model": "tiny", "messages": _maze_messages(), "max_tokens": 2})
                assert ok.status_code == 200
            finally:
                silent.close()
    finally:
        shutdown(endpoint)


def test_a_hundred_streams_opened_and_dropped_leave_nothing_held(endpoint: Any) -> None:
    url = f"{endpoint.base_url}/chat/completions"
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
        for k in range(100):
            if k % 2:  # dropped after its first chunk
                with client.stream("POST", url, json=_long_stream()) as response:
                    assert next(response.iter_lines()).startswith("data: ")
            else:  # dropped before any answer
                _raw_request(endpoint, _long_stream()).close()
            _until_nothing_held(client, endpoint)
        stats = _until_nothing_held(client, endpoint)
        assert stats["refused_queue_full"] == 0
        assert client.post(url, json={"model": "tiny", "messages": _maze_messages(),
                                      "max_tokens": 2}).status_code == 200
