"""Ray Serve deployment of the OpenAI-compatible app: N replicas, each with its own engine and
adapter LRU, behind Ray Serve's HTTP proxy on 127.0.0.1; or, with address "", the same app on a
uvicorn thread of this process (one replica, no Ray: a notebook's quick look).

    python -m workbench serve --adapters s3://bucket/workbench --replicas 2 --port 8000
    endpoint = serve(adapters="s3://bucket/workbench", replicas=2)     # from a notebook
    OpenAI(base_url=endpoint.base_url, api_key=...).chat.completions.create(model=..., ...)
    shutdown(endpoint)
    endpoint = serve(adapters="runs/store", address="")                # in this process
    endpoint = serve(model, adapters="runs/store", engine="vllm", address="")   # vLLM (GPU)

The replica class is `@serve.ingress()` over `workbench.serve.app.build_app(engine)`, built at
replica start (`__serve_build_asgi_app__`), so the same app runs under Ray and in unit tests.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from workbench.deps import require
from workbench.serve.engine import ServeSettings, close_engine, key_hash

APP_NAME = "workbench"


@dataclass(frozen=True)
class Endpoint:
    """A running server: where to send OpenAI requests, and the base model id."""

    base_url: str  # http://127.0.0.1:<port>/v1
    model: str  # the base id; adapters are f"{model}:{name}"
    num_replicas: int
    stop: Callable[[], None] | None = None  # in this process: stops its server; None: Ray Serve


def deployment(settings: ServeSettings) -> Any:
    """The bound Ray Serve application (not started)."""
    require("fastapi")
    serve = require("ray.serve")
    from workbench.serve.app import build_app
    from workbench.serve.replica import open_replica

    # one more than max_queue: the replica's own bound answers (429) before Ray Serve's proxy
    # would start queueing requests for a full replica without bound
    @serve.deployment(name="openai", num_replicas=settings.num_replicas,
                      max_ongoing_requests=settings.max_queue + 1,
                      ray_actor_options={"num_cpus": settings.cpus_per_replica,
                                         "num_gpus": settings.gpus_per_replica})
    @serve.ingress()
    class OpenAIReplica:
        """One replica: an engine (base + adapter LRU) and the app over it."""

        def __init__(self, settings: ServeSettings) -> None:
            self.engine = open_replica(settings)

        def __serve_build_asgi_app__(self) -> Any:
            return build_app(self.engine)

    # serve.deployment makes the class a Deployment; mypy keeps a decorated class's own type
    return OpenAIReplica.bind(settings)  # type: ignore[attr-defined]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start(settings: ServeSettings, address: str = "local", num_cpus: int = 0,
          temp_dir: str = "", log: Callable[[str], None] = print) -> Endpoint:
    """Connect to Ray (a local instance on 127.0.0.1 by default), start Serve's HTTP proxy on
    settings.host:port (port 0: a free port) and deploy; returns once every replica is up."""
    from workbench.cluster import connect

    if settings.port == 0:
        settings = replace(settings, port=free_port(settings.host))
    if address == "":
        return start_in_process(settings, log)
    connect(address, num_cpus=num_cpus or None, temp_dir=temp_dir or None, log=log)
    serve = require("ray.serve")
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(deployment(settings), name=APP_NAME, route_prefix="/")
    endpoint = Endpoint(f"http://{settings.host}:{settings.port}/v1", settings.base_id,
                        settings.num_replicas)
    key = ", API key required" if settings.api_key_sha256 else ""
    log(f"serving {settings.base_id} (+ adapters from {settings.adapters or 'nowhere'}) at "
        f"{endpoint.base_url} with {settings.num_replicas} replica(s), adapter cache "
        f"{settings.cache_size} per replica{key}")
    return endpoint


def serve(model: str = "tiny", adapters: str = "", replicas: int = 1, port: int = 8000,
          api_key: str = "", cache_size: int = 4, address: str = "local",
          log: Callable[[str], None] = print, engine: str = "transformers",
          **settings: Any) -> Endpoint:
    """Start the endpoint from a notebook or script (see `start`); engine "vllm" serves through
    vLLM on the GPU (device cuda); `settings` are further ServeSettings fields (served_name,
    endpoint_url, cpus_per_replica, gpu_memory_utilization, ...)."""
    if engine == "vllm":
        settings.setdefault("device", "cuda")
    config = replace(ServeSettings(), model=model, adapters=adapters, num_replicas=replicas,
                     port=port, api_key_sha256=key_hash(api_key), cache_size=cache_size,
                     engine=engine, **settings)
    return start(config, address, log=log)


def uvicorn_thread(app: Any, host: str, port: int, name: str, on_failure: Callable[[], None],
                   **config: Any) -> Callable[[], None]:
    """`app` served by uvicorn on a daemon thread of this process, once it listens -> a function
    that stops it; a server that does not start (a taken port) runs `on_failure` and raises."""
    uvicorn = require("uvicorn")
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           **config))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    while not server.started:  # uvicorn sets it once the socket listens
        if not thread.is_alive():
            on_failure()
            raise RuntimeError(f"the server did not start on {host}:{port} "
                               "(is the port taken?)")
        thread.join(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join()
    return stop


def start_in_process(settings: ServeSettings, log: Callable[[str], None] = print) -> Endpoint:
    """The same app on a uvicorn thread of this process, no Ray; returns once it listens."""
    if settings.num_replicas != 1:
        raise ValueError(f"{settings.num_replicas} replicas need Ray: pass address='local' "
                         "(or a cluster); in this process there is one")
    require("uvicorn")
    from workbench.serve.app import build_app
    from workbench.serve.replica import open_replica

    engine = open_replica(settings)
    stop_server = uvicorn_thread(build_app(engine), settings.host, settings.port,
                                 "workbench-serve", lambda: close_engine(engine))

    def stop() -> None:
        stop_server()
        close_engine(engine)

    endpoint = Endpoint(f"http://{settings.host}:{settings.port}/v1", settings.base_id, 1, stop)
    log(f"serving {settings.base_id} (+ adapters from {settings.adapters or 'nowhere'}) at "
        f"{endpoint.base_url} in this process, {settings.engine} engine, adapter cache "
        f"{settings.cache_size}")
    return endpoint


def shutdown(endpoint: Endpoint | None = None, disconnect: bool = False) -> None:
    """Stop the endpoint: its in-process server, or the Serve application (and leave Ray when
    disconnect)."""
    if endpoint is not None and endpoint.stop is not None:
        endpoint.stop()
        return
    serve = require("ray.serve")
    serve.shutdown()
    if disconnect:
        from workbench.cluster import disconnect as leave

        leave()
