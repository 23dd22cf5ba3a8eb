"""Training sessions as a service: one session spec behind the HTTP API of the `tinker` SDK,
for several users at once, each with a LoRA of their own over the one base (docs/service.md).

    python -m workbench session-server --preset tiny --api-key tml-... --port 8100
    server = start(spec, ServiceSettings(), port=0)     # from Python (a uvicorn thread)
    tinker.ServiceClient(base_url=server.url, api_key="tml-...")
    server.stop()

`service.service` holds the users, their calls and their order; `service.app` the HTTP routes;
`service.wire` turns the SDK's datums, prompts and results into the workbench's records and back.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.deps import require
from workbench.service.service import Service, ServiceError, ServiceSettings, Usage
from workbench.session.spec import SessionSpec

__all__ = ["Server", "Service", "ServiceError", "ServiceSettings", "Usage", "start"]


@dataclass
class Server:
    """A running session server: its URL, its service, and how to stop it."""

    url: str
    service: Service
    stop: Callable[[], None]
    tokenizer_dir: str


def start(spec: SessionSpec, settings: ServiceSettings = ServiceSettings(),
          host: str = "127.0.0.1", port: int = 0, log: Callable[[str], Any] = print) -> Server:
    """Open `spec`'s session (in-process, or on Ray by spec.cluster) and serve it on a uvicorn
    thread of this process; returns once it listens (port 0: a free port)."""
    require("uvicorn")
    require("tinker")  # its protobuf schema reads the SDK's forward_backward bodies
    from workbench.opener import open_session
    from workbench.policy import chat_format
    from workbench.serve.deploy import free_port, uvicorn_thread
    from workbench.service.app import build_app

    if spec.lora is None:
        raise ValueError("a session server gives each user a LoRA of their own: its spec needs "
                         "lora settings (the largest rank it serves)")
    session = open_session(spec, log=log)
    processor = session.training_client.get_processor()
    tokenizer_dir = str((Path(spec.workdir) / "processor").resolve())
    processor.save_pretrained(tokenizer_dir)  # the tokenizer, and the image pipeline too
    executor: Any = session  # the clients' Executor (each backend is one)
    model_dir = executor.submit(operator.attrgetter("lm.path")).result()
    text_config = executor.submit(operator.attrgetter("lm.model.config.text_config")).result()
    model_len, vocab = text_config.max_position_embeddings, text_config.vocab_size
    aliases = tuple(str(p) for p in (model_dir, tokenizer_dir) if p)
    service = Service(session, settings, spec.model, spec.lora.rank, aliases)
    app = build_app(service, processor, chat_format(processor), tokenizer_dir,
                    settings.max_context or min(int(model_len), 32768), int(vocab))
    port = port or free_port()
    stop_server = uvicorn_thread(app, host, port, "workbench-session-server", service.close,
                                 timeout_graceful_shutdown=5)

    def stop() -> None:
        stop_server()
        service.close()

    log(f"session server on http://{host}:{port} serving {spec.model} "
        f"(LoRA rank up to {spec.lora.rank}; run folder {spec.workdir})")
    return Server(f"http://{host}:{port}", service, stop, tokenizer_dir)
