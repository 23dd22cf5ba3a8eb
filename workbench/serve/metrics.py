"""Prometheus metrics of one app (`workbench.serve.app.build_app`), in a registry of its own:
several apps may live in one process (tests, notebooks), and each counts only its own requests.
The app serves them at GET /metrics (with the API key, when one is set).

    workbench_serve_requests_total{model,outcome,status}  chat requests: outcome "ok" or the
                                                          error code, status the HTTP status
    workbench_serve_refusals_total{reason}                every 4xx / 5xx answer, by error code
    workbench_serve_queue_depth                           requests held now (running or waiting)
    workbench_serve_time_to_first_token_seconds{model}    arrival to the first token
    workbench_serve_request_latency_seconds{model}        arrival to the response's end
    workbench_serve_prompt_tokens_total{model}            the replies' usage.prompt_tokens
    workbench_serve_completion_tokens_total{model}        the replies' usage.completion_tokens
    workbench_serve_adapter_loads_total                   adapters loaded onto the replica
    workbench_serve_adapter_evictions_total               adapters evicted from its LRU
    workbench_serve_adapters_resident                     adapters loaded now

The histograms and token counters count the chat requests answered 200. A `model` label is
either the base id or a `<base>:<adapter>` this app has served at least once (so at most the
published adapters); any other request counts under model="". A stream's first token is its
first token chunk; unstreamed, the first token comes with the whole reply.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from workbench.deps import require
from workbench.serve.engine import Replica
from workbench.serve.limits import Gate

PREFIX = "workbench_serve_"
CHAT_PATH = "/v1/chat/completions"
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                     float("inf"))
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 500: "internal_error"}
"""The error code of an answer that names none (a path or method this app does not serve)."""


@dataclass
class ServeMetrics:
    """One app's registry and the metrics it records per request (the queue depth and the
    adapter counters are read from the gate and the replica when scraped)."""

    registry: Any  # prometheus_client.CollectorRegistry
    base: str  # the base id: always a model label
    requests: Any  # Counter: model, outcome, status
    refusals: Any  # Counter: reason
    time_to_first_token: Any  # Histogram: model
    latency: Any  # Histogram: model
    prompt_tokens: Any  # Counter: model
    completion_tokens: Any  # Counter: model
    served: set[str] = field(default_factory=set)  # models answered 200: labels of their own


def open_metrics(engine: Replica, gate: Gate) -> ServeMetrics:
    """The metrics of an app over `engine` whose queue is `gate`, in a new registry
    (ImportError naming the `serve` extra without prometheus_client)."""
    require("prometheus_client")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    Gauge(PREFIX + "queue_depth", "Requests this replica holds now, running or waiting "
          "(max_queue at most)", registry=registry).set_function(lambda: gate.held)
    registry.register(AdapterCollector(engine))
    model = ("model",)
    return ServeMetrics(
        registry, engine.settings.base_id,
        Counter(PREFIX + "requests", "Chat completion requests by model (the base or a served "
                "adapter, else empty), outcome (ok or the error code) and HTTP status",
                ("model", "outcome", "status"), registry=registry),
        Counter(PREFIX + "refusals", "Answers with a 4xx or 5xx status, by error code",
                ("reason",), registry=registry),
        Histogram(PREFIX + "time_to_first_token_seconds", "Seconds from a chat request's "
                  "arrival to its first token (a stream's first token chunk; unstreamed, the "
                  "first token comes with the whole reply); requests answered 200", model,
                  registry=registry, buckets=LATENCY_BUCKETS_S),
        Histogram(PREFIX + "request_latency_seconds", "Seconds from a chat request's arrival "
                  "to its response being sent (a stream: to its end); requests answered 200",
                  model, registry=registry, buckets=LATENCY_BUCKETS_S),
        Counter(PREFIX + "prompt_tokens", "Prompt tokens of the replies (usage.prompt_tokens)",
                model, registry=registry),
        Counter(PREFIX + "completion_tokens", "Completion tokens of the replies "
                "(usage.completion_tokens)", model, registry=registry))


class AdapterCollector:
    """The replica's adapter LRU counters (`Replica.counters`), read when scraped (a
    prometheus_client collector: an object with `collect`)."""

    def __init__(self, engine: Replica) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counters = self.engine.counters
        yield CounterMetricFamily(PREFIX + "adapter_loads", "Adapters loaded onto this replica "
                                  "(fetched, checked and loaded on a cache miss)",
                                  value=counters["loads"])
        yield CounterMetricFamily(PREFIX + "adapter_evictions", "Adapters evicted from this "
                                  "replica's LRU (beyond cache_size)", value=counters["evictions"])
        yield GaugeMetricFamily(PREFIX + "adapters_resident", "Adapters loaded on this replica "
                                "now", value=len(self.engine.resident))


def model_label(metrics: ServeMetrics, model: str) -> str:
    """The `model` label of a request for `model`: the base, an adapter served before, or ""."""
    return model if model == metrics.base or model in metrics.served else ""


def error_code(status: int, code: str) -> str:
    """The error code of an answer: `code` as the app set it, else one for its status."""
    return code or HTTP_CODES.get(status, f"http_{status}")


def record_reply(metrics: ServeMetrics, model: str, reply: dict[str, Any],
                 elapsed_s: float) -> None:
    """A chat reply ready `elapsed_s` after its request arrived: its tokens, its time to first
    token; its model becomes a label of its own."""
    metrics.served.add(model)
    metrics.time_to_first_token.labels(model).observe(elapsed_s)
    metrics.prompt_tokens.labels(model).inc(reply["usage"]["prompt_tokens"])
    metrics.completion_tokens.labels(model).inc(reply["usage"]["completion_tokens"])


def record_answer(metrics: ServeMetrics, path: str, model: str, status: int, code: str,
                  elapsed_s: float | None) -> None:
    """An answer of the app, `elapsed_s` after its request arrived: a refusal (4xx / 5xx) by
    its error code; a chat request by model, outcome and status (and its latency when 200;
    None: a stream, whose latency `record_stream` takes when it ends)."""
    if status >= 400:
        metrics.refusals.labels(error_code(status, code)).inc()
    if path != CHAT_PATH:
        return
    label = model_label(metrics, model)
    outcome = "ok" if status < 400 else error_code(status, code)
    metrics.requests.labels(label, outcome, str(status)).inc()
    if status == 200 and elapsed_s is not None:
        metrics.latency.labels(label).observe(elapsed_s)


def record_first_token(metrics: ServeMetrics, model: str, started: float) -> None:
    """A stream's first token, sent `time.perf_counter() - started` after its request came."""
    metrics.served.add(model)
    metrics.time_to_first_token.labels(model).observe(time.perf_counter() - started)


def record_stream(metrics: ServeMetrics, model: str, prompt_tokens: int,
                  completion_tokens: int, elapsed_s: float) -> None:
    """A stream that ended `elapsed_s` after its request came (finished, or its client gone):
    its tokens sent and its latency."""
    metrics.served.add(model)
    metrics.prompt_tokens.labels(model).inc(prompt_tokens)
    metrics.completion_tokens.labels(model).inc(completion_tokens)
    metrics.latency.labels(model).observe(elapsed_s)


def scrape(metrics: ServeMetrics, accept: str) -> tuple[bytes, str]:
    """The registry in the format the scraper's Accept header asks (Prometheus text by
    default, or OpenMetrics) and its content type."""
    from prometheus_client.exposition import choose_encoder

    encode, content_type = choose_encoder(accept)
    return encode(metrics.registry), content_type
