"""The endpoint's /health and /metrics (`workbench.serve.metrics`), through the ASGI app in
starlette's test client (the tiny model, adapter a0 in a local registry):
- /health answers 200 without the API key, also while the engine's one worker thread is held by
  a request (its lock taken, the request counted in the queue depth); /metrics needs the key;
- after a seeded mix of well-formed and hostile requests, /metrics (parsed by prometheus_client)
  holds exactly the requests by model and outcome, the refusals by reason, the histograms'
  counts, the token sums of the replies' usage and the adapter counters;
- deploy/serve.yaml runs `serve` on the port its probes (/health) and its scrape annotations
  (/metrics) name, on the cluster's image and volume.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from workbench import cli, registry, storage
from workbench.envs import MazeConfig, eval_set
from workbench.serve import ServeSettings, key_hash
from workbench.serve.client import first_messages

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
parser = pytest.importorskip("prometheus_client.parser")

KEY = "metrics-key-51b0"
SEED = 5
CHAT = "/v1/chat/completions"
MAZE = MazeConfig(size=5, max_turns=4)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def metrics_store(tmp_path_factory: pytest.TempPathFactory,
                  lora_adapters: dict[str, Path]) -> storage.Store:
    """A local registry with one adapter, a0."""
    store = storage.open_store(tmp_path_factory.mktemp("metrics-registry"))
    registry.publish(store, lora_adapters["a0"], "a0")
    return store


@pytest.fixture
def client(metrics_store: storage.Store, tiny_dir: Path) -> Iterator[Any]:
    """A fresh app (its own metrics) over the tiny base, in the test client; `client.engine`."""
    from starlette.testclient import TestClient

    from workbench.serve.app import build_app
    from workbench.serve.replica import open_replica

    engine = open_replica(ServeSettings(model=str(tiny_dir), served_name="tiny",
                                        adapters=metrics_store.root, cache_size=2,
                                        api_key_sha256=key_hash(KEY)))
    with TestClient(build_app(engine)) as c:
        c.engine = engine
        yield c


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples called `name` in a scrape, by their labels (sorted (name, value) pairs)."""
    return {tuple(sorted(s.labels.items())): s.value
            for family in parser.text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def scrape(client: Any) -> str:
    response = client.get("/metrics", headers=_auth())
    assert response.status_code == 200 and response.headers["content-type"].startswith(
        "text/plain")
    return response.text


# ------------------------------------------------------------------ /health


def test_health_needs_no_key_and_metrics_does(client: Any) -> None:
    for headers in ({}, _auth("wrong")):
        health = client.get("/health", headers=headers)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
    refused = client.get("/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/health/", headers={}).status_code == 401  # exactly /health goes through
    text = scrape(client)
    assert samples(text, "workbench_serve_refusals_total") == {
        (("reason", "invalid_api_key"),): 2.0}
    assert samples(text, "workbench_serve_requests_total") == {}  # no chat request yet


def test_health_answers_while_the_engine_is_busy(client: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's worker thread is held inside generate (the engine's lock taken) until the
    test lets it go: meanwhile /health and /metrics answer, and the queue depth is 1."""
    import workbench.serve.app as app_module

    started, release, real = threading.Event(), threading.Event(), app_module.generate

    def held_generate(engine: Any, request: Any, deadline: float) -> dict[str, Any]:
        with engine.lock:
            started.set()
            release.wait(timeout=120)
        return real(engine, request, deadline)

    monkeypatch.setattr(app_module, "generate", held_generate)
    body = {"model": "tiny", "messages": first_messages(MAZE, eval_set(5, 1)[0]),
            "max_tokens": 2}
    with cf.ThreadPoolExecutor(1) as pool:
        try:
            held = pool.submit(client.post, CHAT, json=body, headers=_auth())
            assert started.wait(timeout=120)
            health = client.get("/health")
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            assert client.engine.lock.locked() and not held.done()
            assert samples(scrape(client), "workbench_serve_queue_depth") == {(): 1.0}
        finally:
            release.set()
        assert held.result().status_code == 200
    assert samples(scrape(client), "workbench_serve_queue_depth") == {(): 0.0}


# ------------------------------------------------------------------ /metrics after a mix


@dataclass(frozen=True)
class Case:
    """One request of the mix: its body (JSON, or raw bytes), key, and what it must get."""

    name: str
    body: Any
    status: int
    code: str = ""  # the error code ("" for 200)
    label: str = ""  # the model label it counts under
    key: str = KEY


def mix(rng: random.Random) -> list[Case]:
    """3 well-formed requests to the base and 3 to adapter a0, one of them streamed (seeded
    max_tokens, temperature and seed), then one wrong key, one unknown model, one prompt past
    the context and one body that is not JSON; shuffled."""
    maze = first_messages(MAZE, eval_set(5, 1)[0])

    def good(model: str) -> dict[str, Any]:
        return {"model": model, "messages": maze, "max_tokens": rng.randint(1, 4),
                "temperature": rng.choice((0, 0.7, 1.0)), "seed": rng.randrange(2**31)}

    long_prompt = [{"role": "user", "content": "up " * 4100}]  # past the 4,096-token context
    cases = [Case(f"base {k}", good("tiny"), 200, label="tiny") for k in range(3)]
    cases += [Case(f"a0 {k}", good("tiny:a0"), 200, label="tiny:a0") for k in range(2)]
    cases += [Case("a0 streamed", good("tiny:a0") | {
        "stream": True, "stream_options": {"include_usage": True}}, 200, label="tiny:a0")]
    cases += [
        Case("wrong key", good("tiny"), 401, "invalid_api_key", key="not-the-key"),
        Case("unknown model", good("gpt-4"), 404, "model_not_found"),
        Case("prompt past the context", {"model": "tiny", "messages": long_prompt,
                                         "max_tokens": 2}, 400, "context_length_exceeded",
             label="tiny"),
        Case("bad JSON", b'{"model": "tiny", "messages": [', 400, "invalid_request"),
    ]
    rng.shuffle(cases)
    return cases


def send(client: Any, case: Case) -> Any:
    if isinstance(case.body, bytes):
        return client.post(CHAT, content=case.body, headers=_auth(case.key)
                           | {"Content-Type": "application/json"})
    return client.post(CHAT, json=case.body, headers=_auth(case.key))


def reply_usage(response: Any) -> dict[str, int]:
    """The usage of a reply, or of a stream (its last chunk before [DONE])."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        return response.json()["usage"]
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def test_metrics_count_a_seeded_mix_exactly(client: Any) -> None:
    cases, usage = mix(random.Random(SEED)), {"tiny": [0, 0], "tiny:a0": [0, 0]}
    for case in cases:
        response = send(client, case)
        assert response.status_code == case.status, (case.name, response.text[:300])
        if case.status == 200:
            tokens = reply_usage(response)
            usage[case.label][0] += tokens["prompt_tokens"]
            usage[case.label][1] += tokens["completion_tokens"]
        else:
            assert response.json()["error"]["code"] == case.code, case.name
    text = scrape(client)
    assert samples(text, "workbench_serve_requests_total") == {
        (("model", "tiny"), ("outcome", "ok"), ("status", "200")): 3.0,
        (("model", "tiny:a0"), ("outcome", "ok"), ("status", "200")): 3.0,
        (("model", ""), ("outcome", "invalid_api_key"), ("status", "401")): 1.0,
        (("model", ""), ("outcome", "model_not_found"), ("status", "404")): 1.0,
        (("model", "tiny"), ("outcome", "context_length_exceeded"), ("status", "400")): 1.0,
        (("model", ""), ("outcome", "invalid_request"), ("status", "400")): 1.0}
    assert samples(text, "workbench_serve_refusals_total") == {
        (("reason", "invalid_api_key"),): 1.0, (("reason", "model_not_found"),): 1.0,
        (("reason", "context_length_exceeded"),): 1.0, (("reason", "invalid_request"),): 1.0}
    served = {(("model", "tiny"),): 3.0, (("model", "tiny:a0"),): 3.0}
    for histogram in ("time_to_first_token_seconds", "request_latency_seconds"):
        assert samples(text, f"workbench_serve_{histogram}_count") == served, histogram
        buckets = samples(text, f"workbench_serve_{histogram}_bucket")
        assert {k: v for k, v in buckets.items() if ("le", "+Inf") in k} == {
            (("le", "+Inf"), ("model", "tiny")): 3.0,
            (("le", "+Inf"), ("model", "tiny:a0")): 3.0}, histogram
    assert samples(text, "workbench_serve_prompt_tokens_total") == {
        (("model", m),): float(u[0]) for m, u in usage.items()}
    assert samples(text, "workbench_serve_completion_tokens_total") == {
        (("model", m),): float(u[1]) for m, u in usage.items()}
    assert samples(text, "workbench_serve_queue_depth") == {(): 0.0}
    assert samples(text, "workbench_serve_adapter_loads_total") == {(): 1.0}
    assert samples(text, "workbench_serve_adapter_evictions_total") == {(): 0.0}
    assert samples(text, "workbench_serve_adapters_resident") == {(): 1.0}
    stats = client.get("/v1/stats", headers=_auth()).json()
    assert (stats["misses"], stats["loads"], stats["hits"]) == (1, 1, 2)


# ------------------------------------------------------------------ deploy/serve.yaml


def test_serve_manifest_probes_health_and_has_metrics_scraped() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy/serve.yaml").read_text())}
    pod = docs["Deployment"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = cli.build_parser().parse_args(container["command"][3:])
    assert container["command"][:3] == ["python", "-m", "workbench"]
    assert (args.command, args.address, args.host) == ("serve", "", "0.0.0.0")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true",
                                              "prometheus.io/path": "/metrics",
                                              "prometheus.io/port": str(args.port)}
    env = {e["name"]: e for e in container["env"]}
    assert env["WORKBENCH_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "api_key"
    service = docs["Service"]["spec"]
    assert service["selector"] == pod["metadata"]["labels"]
    assert service["ports"] == [{"name": "http", "port": args.port, "targetPort": "http"}]
    cluster = yaml.safe_load((ROOT / "deploy/raycluster.yaml").read_text())
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert container["image"] == head["containers"][0]["image"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {v["persistentVolumeClaim"]["claimName"] for v in head["volumes"]
                      if "persistentVolumeClaim" in v}
    assert env["HF_HOME"]["value"] == "/fsx/hf" and args.adapters.startswith("/fsx/")
