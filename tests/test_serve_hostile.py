"""The endpoint under hostile input, over real HTTP.

`python -m workbench serve --address ""` (uvicorn in its own process, the transformers engine on
the tiny model, adapters a0 a1 a2 in a local registry) takes a seeded corpus of hostile requests
shuffled among well-formed ones, sent by 50 concurrent clients over the base and the 3 adapters:
- every well-formed request gets 200 and a valid completion;
- every hostile one gets its own status (400 / 401 / 404 / 413) and OpenAI's error JSON: a
  prompt past the context (a 1 MB text is refused before it is tokenized), a body past
  max_body_bytes (by its Content-Length, or as it is read when chunked), images past
  max_image_pixels (read from their headers), path traversal, bad JSON, bad fields...;
- the server's resident memory grows by less than RSS_GROWTH_MB;
- the latency percentiles of the well-formed requests are printed (not asserted).
Then, on a server holding at most 2 requests for 1.5 s each: a third request gets 429 with
Retry-After while the two are still in flight, the two get 504, and the server answers again.
Below, without a server: the text bound never claims more tokens than the tokenizer makes.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import stop_process, wait_ready

from workbench import registry, storage
from workbench.envs import MazeConfig, eval_set
from workbench.serve.client import first_messages
from workbench.serve.deploy import free_port
from workbench.serve.limits import TextBound, text_bound

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

KEY = "hostile-key-7c1e"
SEED = 11
CLIENTS = 50
WELL_FORMED = 150
MODELS = ("tiny", "tiny:a0", "tiny:a1", "tiny:a2")
RSS_GROWTH_MB = 300
"""The server's resident memory may grow by this much over the corpus (a 1 MB prompt that
reached the model grew it by 3 GB)."""
MB = 1 << 20
MAZE = MazeConfig(size=5, max_turns=4)
AT_ONCE = ("1 MB prompt", "20 MB body with Content-Length", "20 MB body, chunked",
           "Content-Length 20 MB, no body", "8000 x 8000 image")
"""Cases refused before the queue: their latencies are printed beside the percentiles."""


def _png_url(width: int, height: int) -> str:
    """A real PNG of width x height (1-bit, a few KB however large: what a bomb looks like)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (width, height)).save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


# ------------------------------------------------------------------ the server


@dataclass(frozen=True)
class Server:
    base_url: str
    port: int
    pid: int


@pytest.fixture(scope="module")
def hostile_store(tmp_path_factory: pytest.TempPathFactory,
                  lora_adapters: dict[str, Path]) -> str:
    store = storage.open_store(tmp_path_factory.mktemp("hostile-registry"))
    for name in ("a0", "a1", "a2"):
        registry.publish(store, lora_adapters[name], name)
    return store.root


@pytest.fixture(scope="module")
def server(hostile_store: str, tiny_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`python -m workbench serve --address ""`: uvicorn in its own process, max_queue 64 (the
    50 clients fit), the other limits at their defaults."""
    tmp, port = tmp_path_factory.mktemp("hostile-serve"), free_port()
    cmd = [sys.executable, "-m", "workbench", "serve", "--model", str(tiny_dir), "--served-name",
           "tiny", "--adapters", hostile_store, "--cache-size", "2", "--address", "", "--port",
           str(port), "--api-key", KEY, "--max-queue", "64"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with open(tmp / "serve.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{port}/v1"
            wait_ready(proc, base_url, tmp / "serve.log", KEY, timeout_s=120, every_s=0.5)
            yield Server(base_url, port, proc.pid)
        finally:
            stop_process(proc, timeout_s=30)


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def rss_mb(pid: int) -> float:
    """VmRSS of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ------------------------------------------------------------------ the corpus


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any  # the JSON body (None: not JSON)
    headers: dict[str, str]


@dataclass(frozen=True)
class Case:
    """One request of the corpus and the status (and OpenAI error code) it must get."""

    name: str
    send: Callable[[Any, Server], Reply]  # (httpx.Client, server) -> Reply
    status: int
    code: str | None = None
    model: str = ""  # well-formed: the model asked for
    n: int = 1

    @property
    def well_formed(self) -> bool:
        return bool(self.model)


def _reply(response: Any) -> Reply:
    try:
        body = response.json()
    except ValueError:
        body = None
    return Reply(response.status_code, body, dict(response.headers))


def _post_json(body: Any, key: str = KEY) -> Callable[[Any, Server], Reply]:
    return lambda client, s: _reply(client.post(f"{s.base_url}/chat/completions", json=body,
                                                headers=_auth(key)))


def _post_bytes(content: Any) -> Callable[[Any, Server], Reply]:
    return lambda client, s: _reply(client.post(
        f"{s.base_url}/chat/completions", content=content() if callable(content) else content,
        headers=_auth() | {"Content-Type": "application/json"}))


def _declared_only(client: Any, s: Server) -> Reply:
    """Headers that declare a 20 MB body, and no body: the answer must come without it."""
    with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 20000000\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return Reply(int(head.split()[1]), json.loads(body), {})


def _chunks(total: int) -> Callable[[], Iterator[bytes]]:
    """A chunked body (no Content-Length) of `total` bytes."""
    def chunks() -> Iterator[bytes]:
        for _ in range(total // MB):
            yield b" " * MB
    return chunks


def _chat(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": 2} | extra


def _image(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def hostile_cases(maze: list[dict[str, Any]]) -> list[Case]:
    """Each hostile request once, with its status and OpenAI error code."""
    bad, ctx, img = "invalid_request", "context_length_exceeded", "invalid_image"
    maze_image = maze[1]["content"][0]
    nested: Any = "deep"
    for _ in range(200):  # valid JSON, 200 levels deep where a string belongs
        nested = {"text": nested}
    cases = [
        Case("1 MB prompt", _post_json(_chat("a" * MB)), 400, ctx),
        Case("1 MB prompt of words", _post_json(_chat("up down " * (MB // 8))), 400, ctx),
        Case("prompt of 4,100 tokens", _post_json(_chat("up " * 4100)), 400, ctx),
        Case("prompt + max_tokens past the context", _post_json(_chat("up " * 4000,
                                                                      max_tokens=200)), 400, ctx),
        Case("a prompt near the context", _post_json(_chat("up " * 4000)), 200),
        Case("100,000 empty messages", _post_json(
            {"model": "tiny", "messages": [{"role": "user", "content": ""}] * 100_000}), 400, ctx),
        Case("20 MB body with Content-Length", _post_bytes(b" " * (20 * MB)), 413,
             "request_too_large"),
        Case("20 MB body, chunked", _post_bytes(_chunks(20 * MB)), 413, "request_too_large"),
        Case("Content-Length 20 MB, no body", _declared_only, 413, "request_too_large"),
        Case("8000 x 8000 image", _post_json(_chat([_image(_png_url(8000, 8000))])), 400,
             "image_too_large"),
        Case("two 3000 x 3000 images", _post_json(_chat([_image(_png_url(3000, 3000))] * 2)),
             400, "image_too_large"),
        Case("100 maze images", _post_json(_chat([maze_image] * 100)), 200),
        Case("adapter path traversal", _post_json(_chat(model="tiny:../../etc/passwd")), 404,
             "model_not_found"),
        Case("adapter name with a slash", _post_json(_chat(model="tiny:a0/../a1")), 404,
             "model_not_found"),
        Case("unknown base", _post_json(_chat(model="gpt-4")), 404, "model_not_found"),
        Case("unknown adapter", _post_json(_chat(model="tiny:nope")), 404, "model_not_found"),
        Case("100 KB model name", _post_json(_chat(model="tiny:" + "a" * 100_000)), 404,
             "model_not_found"),
        Case("model not a string", _post_json(_chat(model=["tiny"])), 400, bad),
        Case("remote image URL", _post_json(_chat([_image("http://example.com/x.png")])), 400,
             img),
        Case("file:// image URL", _post_json(_chat([_image("file:///etc/passwd")])), 400, img),
        Case("broken base64", _post_json(_chat([_image("data:image/png;base64,AAA")])), 400, img),
        Case("GIF data URL", _post_json(_chat([_image("data:image/gif;base64,R0lGOD")])), 400,
             img),
        Case("image_url without url", _post_json(_chat([{"type": "image_url",
                                                          "image_url": {}}])), 400, img),
        Case("max_tokens -1", _post_json(_chat(max_tokens=-1)), 400, bad),
        Case("max_tokens 0", _post_json(_chat(max_tokens=0)), 400, bad),
        Case("max_tokens 10**9", _post_json(_chat(max_tokens=10**9)), 400, bad),
        Case("max_tokens '4'", _post_json(_chat(max_tokens="4")), 400, bad),
        Case("max_tokens 1.5", _post_json(_chat(max_tokens=1.5)), 400, bad),
        Case("n 0", _post_json(_chat(n=0)), 400, bad),
        Case("n 10**6", _post_json(_chat(n=10**6)), 400, bad),
        Case("temperature 5", _post_json(_chat(temperature=5)), 400, bad),
        Case("temperature 'hot'", _post_json(_chat(temperature="hot")), 400, bad),
        Case("temperature NaN", _post_bytes(b'{"model": "tiny", "temperature": NaN, '
                                            b'"messages": [{"role": "user", "content": "hi"}]}'),
             400, bad),
        Case("seed 'x'", _post_json(_chat(seed="x")), 400, bad),
        Case("seed 2**70", _post_json(_chat(seed=2**70)), 400, bad),
        Case("stream not a boolean", _post_json(_chat(stream="yes")), 400, bad),
        Case("stream_options without stream", _post_json(_chat(
            stream_options={"include_usage": True})), 400, bad),
        Case("stream_options not an object", _post_json(_chat(stream=True,
                                                              stream_options=[1])), 400, bad),
        Case("no messages", _post_json({"model": "tiny"}), 400, bad),
        Case("empty messages", _post_json({"model": "tiny", "messages": []}), 400, bad),
        Case("messages a string", _post_json({"model": "tiny", "messages": "hi"}), 400, bad),
        Case("message not an object", _post_json({"model": "tiny", "messages": [7]}), 400, bad),
        Case("unknown role", _post_json({"model": "tiny", "messages": [
            {"role": "robot" * 10_000, "content": "hi"}]}), 400, bad),
        Case("content a number", _post_json(_chat(5)), 400, bad),
        Case("content an object", _post_json(_chat({"text": "hi"})), 400, bad),
        Case("text part not a string", _post_json(_chat([{"type": "text", "text": 123}])), 400,
             bad),
        Case("text nested 200 deep", _post_json(_chat([{"type": "text", "text": nested}])), 400,
             bad),
        Case("audio part", _post_json(_chat([{"type": "input_audio", "input_audio": {}}])), 400,
             bad),
        Case("image in an assistant turn", _post_json({"model": "tiny", "messages": [
            {"role": "assistant", "content": [maze_image]}]}), 400, bad),
        Case("body a JSON list", _post_json([_chat()]), 400, bad),
        Case("body null", _post_bytes(b"null"), 400, bad),
        Case("bad JSON", _post_bytes(b'{"model": "tiny", "messages": ['), 400, bad),
        Case("not UTF-8", _post_bytes(b'{"model": "\xff\xfe"}'), 400, bad),
        Case("JSON nested 100,000 deep", _post_bytes(b"[" * 100_000 + b"]" * 100_000), 400, bad),
        Case("wrong API key", _post_json(_chat(), key="not-the-key"), 401, "invalid_api_key"),
        Case("no API key", lambda client, s: _reply(client.post(
            f"{s.base_url}/chat/completions", json=_chat())), 401, "invalid_api_key"),
    ]
    return cases


def well_formed_cases(maze: list[dict[str, Any]], rng: random.Random) -> list[Case]:
    """WELL_FORMED maze turns over the base and the adapters, each with its own settings."""
    cases = []
    for k in range(WELL_FORMED):
        model, n = rng.choice(MODELS), rng.choice((1, 1, 1, 2))
        body = {"model": model, "messages": maze, "max_tokens": rng.randint(1, 4), "n": n,
                "temperature": rng.choice((0, 0.7, 1.0)), "seed": rng.randrange(2**31)}
        cases.append(Case(f"well-formed {k}", _post_json(body), 200, model=model, n=n))
    return cases


def _check_completion(case: Case, body: Any, prompt_tokens: int) -> None:
    assert body["object"] == "chat.completion" and body["model"] == case.model
    assert len(body["choices"]) == case.n
    for choice in body["choices"]:
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] == prompt_tokens and 1 <= usage["completion_tokens"] <= 4 * case.n


class PeakRss:
    """The largest VmRSS of `pid` seen while running (polled every 50 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss_mb(pid), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mb(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _send(client: Any, server: Server, case: Case) -> tuple[Case, Reply, float]:
    start = time.perf_counter()
    reply = case.send(client, server)
    return case, reply, time.perf_counter() - start


def test_hostile_corpus_among_50_clients(server: Server) -> None:
    maze, rng = first_messages(MAZE, eval_set(5, 1)[0]), random.Random(SEED)
    corpus = hostile_cases(maze) + well_formed_cases(maze, rng)
    rng.shuffle(corpus)
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    with httpx.Client(timeout=120, limits=limits) as client:
        warm = _post_json({"model": "tiny", "messages": maze, "max_tokens": 1})(client, server)
        assert warm.status == 200
        prompt_tokens = warm.body["usage"]["prompt_tokens"]
        rss_before = rss_mb(server.pid)
        with PeakRss(server.pid) as rss, cf.ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(lambda case: _send(client, server, case), corpus))
        stats = client.get(f"{server.base_url}/stats", headers=_auth()).json()
    wrong = [(case.name, case.status, reply.status, str(reply.body)[:300])
             for case, reply, _ in results if reply.status != case.status]
    assert not wrong, wrong
    for case, reply, _ in results:
        if case.well_formed:
            _check_completion(case, reply.body, prompt_tokens)
        elif case.status != 200:
            error = reply.body["error"]
            assert set(error) == {"message", "type", "code", "param"}, case.name
            assert error["code"] == case.code and len(error["message"]) < 1000, (case.name, error)
    latencies_s = np.array([t for case, _, t in results if case.well_formed])
    p50, p90, p99 = np.percentile(latencies_s, [50, 90, 99])
    at_once = {case.name: t for case, _, t in results if case.name in AT_ONCE}
    print(f"\n{len(latencies_s)} well-formed requests among {len(results) - len(latencies_s)} "
          f"hostile ones, {CLIENTS} clients: p50 {p50:.3f} s, p90 {p90:.3f} s, p99 {p99:.3f} s; "
          f"refused before the queue: {', '.join(f'{n} {t:.3f} s' for n, t in at_once.items())};"
          f" server RSS {rss_before:.0f} MiB before, peak {rss.peak:.0f} MiB")
    assert rss.peak - rss_before < RSS_GROWTH_MB, (rss_before, rss.peak)
    assert stats["in_flight"] == 0 and stats["refused_queue_full"] == 0
    assert stats["load_failures"] == 0 and len(stats["resident"]) <= 2


def test_past_max_queue_a_request_gets_429_at_once_and_slow_ones_504(tiny_dir: Path) -> None:
    """max_queue 2, request_timeout_s 1.5: two long requests (16 replies of up to 2,048 tokens
    each: far more decoding than 1.5 s on any CPU, where 256 tokens can take less) are held; a
    third gets 429 with Retry-After while both are still in flight; both then get 504 (one
    stopped between decode steps, one while waiting for the engine); the server answers the
    next request."""
    from workbench.serve import serve, shutdown

    endpoint = serve(str(tiny_dir), served_name="tiny", port=0, api_key=KEY, address="",
                     max_queue=2, request_timeout_s=1.5, max_tokens_limit=2048,
                     log=lambda line: None)
    url = f"{endpoint.base_url}/chat/completions"
    slow = _chat("up " * 1300, n=16, max_tokens=2048, temperature=1.0)
    try:
        with httpx.Client(timeout=60, headers=_auth()) as client, \
                cf.ThreadPoolExecutor(2) as pool:
            held = [pool.submit(client.post, url, json=slow) for _ in range(2)]
            while client.get(f"{endpoint.base_url}/stats").json()["in_flight"] < 2:
                time.sleep(0.005)
            refused = client.post(url, json=_chat())
            assert not any(f.done() for f in held)  # the 429 came while both were held
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            assert "max_queue 2" in refused.json()["error"]["message"]
            for future in held:
                response = future.result()
                assert response.status_code == 504, response.text
                error = response.json()["error"]
                assert error["code"] == "timeout" and "request_timeout_s of 1.5 s" in \
                    error["message"]
            assert client.post(url, json=_chat()).status_code == 200
            stats = client.get(f"{endpoint.base_url}/stats").json()
        assert stats["in_flight"] == 0 and stats["refused_queue_full"] == 1
    finally:
        shutdown(endpoint)


# ------------------------------------------------------------------ the text bound


def test_the_text_bound_never_claims_more_tokens_than_the_tokenizer_makes(tiny) -> None:
    tokenizer = tiny.processor.tokenizer
    bound = text_bound(tokenizer)
    assert isinstance(bound, TextBound) and bound.vocab_chars >= 1
    assert "<|im_end|>" in bound.added
    rng = random.Random(SEED)
    pieces = [*bound.added, "up", " ", "\n", "é", "中", "🙂", "\u0301", "aaaa", "<|im_", "end|>"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 60)))
        assert bound.min_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False))
    assert bound.min_tokens("a" * MB) >= MB // bound.vocab_chars  # refused untokenized


def test_no_text_bound_where_none_is_proven(tiny) -> None:
    """A normalizer (NFC can merge characters) or a pre-tokenizer that drops whitespace: no
    bound, so such texts are tokenized before they are measured."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    spec = json.loads(tiny.processor.tokenizer.backend_tokenizer.to_str())
    for change in ({"normalizer": {"type": "NFC"}},
                   {"pre_tokenizer": {"type": "Whitespace"}},
                   {"pre_tokenizer": {"type": "Split", "pattern": {"String": " "},
                                      "behavior": "Removed", "invert": False}}):
        tokenizer = Tokenizer.from_str(json.dumps(spec | change))
        assert text_bound(SimpleNamespace(backend_tokenizer=tokenizer)) is None
    assert text_bound(SimpleNamespace()) is None  # a slow (Python) tokenizer
