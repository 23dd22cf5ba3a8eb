"""The session server as a hostile client and a crash see it, over real HTTP, with the server in
a process of its own (`python -m workbench session-server`):
- a seeded corpus of malformed, oversized and foreign requests, sent by 20 clients among
  well-formed ones: each gets its own 4xx at once, with a message naming what is wrong; the
  well-formed ones all succeed and the server's memory stays flat;
- both servers (this one and the OpenAI endpoint) drop a client whose body stops arriving
  after body_timeout_s (a 408, then the connection closed: the file handles come back), and a
  client that disconnects mid-body costs one log line;
- a server killed with SIGKILL mid-call loses no saved state: restarted on its run folder, a
  client resumes from the newest state it lists and trains on exactly as an uninterrupted run.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import stop_process

tinker = pytest.importorskip("tinker", reason="needs the service extra")
os.environ["TINKER_TELEMETRY"] = "0"

import httpx  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

from workbench.serve.deploy import free_port  # noqa: E402

KEY = "tml-hostile-3f9a"
SEED = 5
CLIENTS = 20
RSS_GROWTH_MB = 300
STALLED = 200  # connections that send 9 of 1,000 bytes


@dataclass
class Running:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path


def start_server(sft_model: str, folder: Path, *extra: str, port: int = 0) -> Running:
    port = port or free_port()
    log = folder / f"server-{port}.log"
    cmd = [sys.executable, "-m", "workbench", "session-server", "--port", str(port),
           "--api-key", KEY, *extra, f"model.name={sft_model}", f"run_dir={folder / 'run'}"]
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env=os.environ | {"OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"session-server exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": KEY}).status_code \
                    == 200:
                return Running(url, port, proc, log)
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail("session-server did not start within 180 s")


@pytest.fixture(scope="module")
def server(sft_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    running = start_server(sft_model, tmp_path_factory.mktemp("hostile-service"),
                           "--max-body-bytes", "2000000", "--body-timeout-s", "1")
    yield running
    stop_process(running.proc, timeout_s=30)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ------------------------------------------------------------------------ the corpus

def png(width: int, height: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (width, height)).save(out, format="PNG")
    return out.getvalue()


def proto_forward(model_id: str, loss_fn: str = "cross_entropy", seq_id: int = 1,
                  chunks: list[Any] | None = None, n: int = 4, targets: Any = None,
                  inputs: dict[str, Any] | None = None, config: dict | None = None) -> bytes:
    """A ForwardBackwardRequest of one datum (text tokens 1..n unless `chunks`)."""
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn)
    for key, value in (config or {}).items():
        message.loss_fn_config[key] = value
    datum = message.data.add()
    for chunk in chunks or [("text", list(range(1, n + 1)))]:
        c = datum.model_input.add()
        if chunk[0] == "text":
            c.encoded_text.tokens = np.asarray(chunk[1], "<i4").tobytes()
        else:
            c.image.data, c.image.format = chunk[1], "png"
            if len(chunk) > 2:
                c.image.expected_tokens = chunk[2]
    fields = inputs if inputs is not None else {
        "target_tokens": np.asarray(targets if targets is not None else
                                    list(range(2, n + 2)), np.int64),
        "weights": np.ones(n, np.float32)}
    for key, array in fields.items():
        t = datum.loss_fn_inputs[key]
        t.dense = np.asarray(array).astype("<f4" if array.dtype.kind == "f" else "<i8").tobytes()
        t.dtype = pb.DTYPE_FLOAT32 if array.dtype.kind == "f" else pb.DTYPE_INT64
        t.shape.extend(array.shape)
    return message.SerializeToString()


@dataclass(frozen=True)
class Case:
    name: str
    send: Callable[[httpx.Client, str], httpx.Response]
    status: int
    says: str = ""  # what the message names


def post(path: str, body: Any, key: str = KEY) -> Callable[[httpx.Client, str], Any]:
    return lambda c, url: c.post(f"{url}/api/v1/{path}", json=body, headers={"X-API-Key": key})


def raw(path: str, content: bytes, kind: str = "application/json"
        ) -> Callable[[httpx.Client, str], Any]:
    return lambda c, url: c.post(f"{url}/api/v1/{path}", content=content,
                                 headers={"X-API-Key": KEY, "Content-Type": kind})


def fb(body: bytes) -> Callable[[httpx.Client, str], Any]:
    return raw("forward_backward", body, "application/x-protobuf")


def hostile_cases(sid: str, model: str, sampler: str, base: str) -> list[Case]:
    text = {"type": "encoded_text", "tokens": [1, 2, 3]}
    sample = {"sampling_session_id": sampler, "seq_id": 0, "num_samples": 1,
              "prompt": {"chunks": [text]}, "sampling_params": {"max_tokens": 2}}
    return [
        Case("no key", post("create_session", {}, key=""), 401, "X-API-Key"),
        Case("wrong key", post("create_session", {}, key="tml-wrong"), 401, "API key"),
        Case("not JSON", raw("create_session", b"{nope"), 400, "not valid JSON"),
        Case("a JSON list", post("create_session", [1, 2]), 400, "JSON object"),
        Case("session_id missing", post("create_model", {"model_seq_id": 9,
                                                         "base_model": "x"}), 400,
             "session_id is required"),
        Case("session_id a number", post("create_model", {"session_id": 5, "model_seq_id": 9,
                                                          "base_model": "x"}), 400, "str"),
        Case("unknown session", post("create_model", {"session_id": "sess-none",
                                                      "model_seq_id": 0, "base_model": "x"}),
             404, "no session"),
        Case("another base", post("create_model", {"session_id": sid, "model_seq_id": 99,
                                                   "base_model": "Qwen/Qwen3-VL-8B"}), 404,
             "is not served here"),
        Case("rank 4096", post("create_model", {"session_id": sid, "model_seq_id": 98,
                                                "base_model": base,
                                                "lora_config": {"rank": 4096}}), 400,
             "rank 1 to"),
        Case("muon", post("create_model", {"session_id": sid, "model_seq_id": 97,
                                           "base_model": "x",
                                           "optimizer_config": {"type": "dimuon"}}), 400,
             "adamw only"),
        Case("fb as JSON", post("forward_backward", {"model_id": model}), 415, "protobuf"),
        Case("fb garbage", fb(b"\xff\xfe not a message \x00" * 50), 400,
             "not a tinker ForwardBackwardRequest"),
        Case("fb unknown model", fb(proto_forward("sess-x:train:0")), 404, "no training client"),
        Case("fb loss dro", fb(proto_forward(model, "dro")), 400, "choose one of"),
        Case("fb unknown config", fb(proto_forward(model, "ppo", config={"beta": 1.0}, inputs={
            "target_tokens": np.arange(2, 6), "logprobs": np.zeros(4, np.float32),
            "advantages": np.ones(4, np.float32)})), 400, "not known for ppo"),
        Case("fb short targets", fb(proto_forward(model, targets=[2, 3])), 400, "shape"),
        Case("fb target not next", fb(proto_forward(model, targets=[2, 3, 9, 5])), 400,
             "next text token"),
        Case("fb token past vocab", fb(proto_forward(model, chunks=[("text", [1, 10**6, 3])],
                                                     n=3, targets=[10**6, 3, 4])), 400,
             "vocabulary"),
        Case("fb image not png", fb(proto_forward(model, chunks=[
            ("text", [1]), ("image", b"\x89PNG broken" * 10)], n=2, targets=[0, 1],
            inputs={"target_tokens": np.zeros(2, np.int64),
                    "weights": np.zeros(2, np.float32)})), 400, "not a readable png"),
        Case("fb image bomb", fb(proto_forward(model, chunks=[
            ("text", [1]), ("image", png(20000, 20000))], n=2)), 400, "pixels"),
        Case("fb expected_tokens", fb(proto_forward(model, chunks=[
            ("text", [1]), ("image", png(32, 32), 999)], n=2)), 400, "expected_tokens"),
        Case("fb NaN", fb(proto_forward(model, "importance_sampling", inputs={
            "target_tokens": np.arange(2, 6), "logprobs": np.full(4, np.nan, np.float32),
            "advantages": np.ones(4, np.float32)})), 400, "NaN"),
        Case("sample unknown sampler", post("asample", {**sample,
                                                        "sampling_session_id": "sess-x:s:0"}),
             404, "no session"),
        Case("sample top_p", post("asample", {**sample, "sampling_params": {"top_p": 0.5}}),
             400, "top_k and top_p"),
        Case("sample stop", post("asample", {**sample, "sampling_params": {"stop": ["\n"]}}),
             400, "stops at"),
        Case("sample n 1000", post("asample", {**sample, "num_samples": 1000}), 400,
             "num_samples"),
        Case("sample pointer", post("asample", {**sample, "prompt": {"chunks": [
            {"type": "image_asset_pointer", "location": "file:///etc/passwd",
             "format": "png"}]}}), 400, "image_asset_pointer"),
        Case("sample bad base64", post("asample", {**sample, "prompt": {"chunks": [
            {"type": "image", "data": "%%%", "format": "png"}]}}), 400, "base64"),
        Case("sample past context", post("asample", {**sample, "sampling_params": {
            "max_tokens": 10**7}}), 400, "context"),
        Case("adam unknown key", post("optim_step", {"model_id": model, "seq_id": 50,
                                                     "adam_params": {"momentum": 0.9}}), 400,
             "not known"),
        Case("adam lr text", post("optim_step", {"model_id": model, "seq_id": 50,
                                                 "adam_params": {"learning_rate": "fast"}}),
             400, "float"),
        Case("save traversal", post("save_weights", {"model_id": model, "seq_id": 50,
                                                     "path": "../../etc"}), 400,
             "checkpoint name"),
        Case("load traversal", post("load_weights", {"session_id": sid, "model_seq_id": 96,
                                                     "path": "tinker://a/weights/../../x"}),
             400, "tinker://"),
        Case("load missing", post("load_weights", {"session_id": sid, "model_seq_id": 95,
                                                   "path": "tinker://a:train:0/weights/none"}),
             404, "no checkpoint"),
        Case("unknown future", post("retrieve_future", {"request_id": "req-none"}), 404,
             "no call"),
        Case("body past limit", raw("create_session", b"{" + b" " * 3_000_000 + b"}"), 413,
             "max_body_bytes"),
        Case("unknown endpoint", post("unload_model", {"model_id": model}), 404, "not served"),
        Case("heartbeat unknown", post("session_heartbeat", {"session_id": "sess-x"}), 410,
             "not running"),
    ]


def well_formed(sampler: str, rng: random.Random, i: int) -> Case:
    """A real call: the capabilities, a new session, or a sample."""
    kind = rng.choice(["capabilities", "session", "sample"])
    if kind == "capabilities":
        return Case(f"ok {i} capabilities", lambda c, u: c.get(
            f"{u}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}), 200)
    if kind == "session":
        return Case(f"ok {i} session", post("create_session", {"tags": []}), 200)
    return Case(f"ok {i} sample", post("asample", {
        "sampling_session_id": sampler, "seq_id": i, "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, i % 50]}]},
        "sampling_params": {"max_tokens": 3, "seed": i}}), 200)


def test_hostile_corpus_among_20_clients(server: Running) -> None:
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    caps = client.get_server_capabilities()
    base = caps.supported_models[0].model_name
    tc = client.create_lora_training_client(base_model=base, rank=2).result()
    sampler_id = tc.save_weights_and_get_sampling_client().result()._sampling_session_id
    sid = tc.model_id.split(":")[0]
    rng = random.Random(SEED)
    corpus = hostile_cases(sid, tc.model_id, sampler_id, base) + [
        well_formed(sampler_id, rng, i) for i in range(60)]
    rng.shuffle(corpus)
    before = rss_mb(server.proc.pid)
    with httpx.Client(timeout=60) as http, cf.ThreadPoolExecutor(CLIENTS) as pool:
        replies = list(pool.map(lambda case: (case, case.send(http, server.url)), corpus))
        # the SDK's own loop still works beside them
        out = tc.forward_backward([types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})],
            "cross_entropy").result()
    wrong = [(case.name, case.status, r.status_code, r.text[:300]) for case, r in replies
             if r.status_code != case.status]
    assert not wrong, wrong
    for case, r in replies:
        if case.status != 200:
            detail = r.json()["detail"]
            assert case.says in detail and len(detail) < 1000, (case.name, detail)
    assert out.metrics["loss:sum"] > 0
    assert rss_mb(server.proc.pid) - before < RSS_GROWTH_MB
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]


# ------------------------------------------------------------------- slow and gone bodies

def stalled(port: int, path: str, headers: str) -> socket.socket:
    """A connection that sends its headers, announces 1,000 bytes and sends 9."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}"
                 "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                 '{"a": 1, '.encode())
    return sock


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def check_slow_and_gone(port: int, pid: int, log: Path, path: str, headers: str,
                        gone_line: str) -> None:
    """STALLED stalled bodies each get 408 and a closed connection, and the server's file
    handles come back; 100 clients that leave mid-body make 100 lines and no traceback."""
    baseline = open_fds(pid)
    socks = [stalled(port, path, headers) for _ in range(STALLED)]
    for sock in socks:
        data = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            data += chunk
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert b"body_timeout_s" in data
        sock.close()
    deadline = time.monotonic() + 30
    while open_fds(pid) > baseline + 5 and time.monotonic() < deadline:
        time.sleep(0.1)  # waiting for the server to close what it held (an event)
    assert open_fds(pid) <= baseline + 5, (baseline, open_fds(pid))
    for _ in range(100):
        stalled(port, path, headers).close()
    deadline = time.monotonic() + 30
    while log.read_text().count(gone_line) < 100 and time.monotonic() < deadline:
        time.sleep(0.1)
    text = log.read_text()
    assert text.count(gone_line) == 100, text[-2000:]
    assert "Traceback" not in text and "ClientDisconnect" not in text, text[-3000:]


def test_the_session_server_drops_a_body_that_stops_and_logs_a_gone_client_once(
        server: Running) -> None:
    check_slow_and_gone(server.port, server.proc.pid, server.log, "/api/v1/create_session",
                        f"X-API-Key: {KEY}\r\n", "client disconnected mid-body")


def test_the_endpoint_drops_a_body_that_stops_and_logs_a_gone_client_once(
        tiny_dir: Path, tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "workbench", "serve", "--model", str(tiny_dir), "--address",
           "", "--port", str(port), "--api-key", "k-1", "--body-timeout-s", "1"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        from conftest import wait_ready

        wait_ready(proc, f"http://127.0.0.1:{port}/v1", log, "k-1", timeout_s=120, every_s=0.3)
        check_slow_and_gone(port, proc.pid, log, "/v1/chat/completions",
                            "Authorization: Bearer k-1\r\n", "client disconnected mid-body")
    finally:
        stop_process(proc, timeout_s=30)


# ------------------------------------------------------------------------- a crash

def train_steps(tc: Any, datum: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return out


def test_a_server_killed_mid_call_resumes_from_its_newest_state(sft_model: str,
                                                                tmp_path: Path) -> None:
    """Two steps and save_state, then calls in flight when SIGKILL comes; the server restarted
    on its run folder lists the state, and a client made from it takes step 3 with the loss
    of an uninterrupted run's step 3, and the same loss after it."""
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8, 9]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9, 10],
                                        "weights": [1.0] * 5})
    first = start_server(sft_model, tmp_path)
    client = tinker.ServiceClient(base_url=first.url, api_key=KEY)
    base = client.get_server_capabilities().supported_models[0].model_name
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=1).result()
    train_steps(tc, datum, 2)
    saved = tc.save_state("step-2").result().path
    in_flight = [tc.forward_backward([datum] * 8, "cross_entropy") for _ in range(4)]
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    del in_flight
    second = start_server(sft_model, tmp_path, port=first.port)
    try:
        client = tinker.ServiceClient(base_url=second.url, api_key=KEY)
        listed = tinker.RestClient(base_url=second.url, api_key=KEY).list_checkpoints(
            tc.model_id).result().checkpoints
        assert [c.tinker_path for c in listed] == [saved]
        resumed = client.create_training_client_from_state_with_optimizer(saved).result()
        straight = client.create_lora_training_client(base_model=base, rank=4,
                                                      seed=1).result()
        assert train_steps(resumed, datum, 2) == train_steps(straight, datum, 4)[2:]
    finally:
        stop_process(second.proc, timeout_s=30)
