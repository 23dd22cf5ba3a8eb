"""Serving: an OpenAI-compatible endpoint over one base model and many LoRA adapters
(`<base>:<adapter>`), adapters fetched from the registry's store on first use and LRU-cached per
replica; Ray Serve runs the replicas (or, with address "", a uvicorn thread of this process).
See `workbench.serve.deploy` (start, serve, shutdown),
`workbench.serve.app` (the ASGI app), `workbench.serve.engine` (base + adapters + sampler),
`workbench.serve.limits` (what one request may take: body, context, pixels, queue, time),
`workbench.serve.metrics` (the Prometheus metrics of /metrics),
`workbench.serve.parity` (served log-probs against the trainer's) and
`workbench.serve.vllm` (the GPU config for Ray Serve LLM).

Nothing here imports Ray, FastAPI or boto3 until a function needs them.
"""

from workbench.serve.chat import ChatRequest, image_data_url, render_messages
from workbench.serve.engine import ServeSettings, key_hash
from workbench.serve.errors import RequestError

__all__ = ["ChatRequest", "RequestError", "ServeSettings", "image_data_url", "key_hash",
           "render_messages", "serve", "shutdown"]


def serve(*args, **kwargs):  # see workbench.serve.deploy.serve
    """Start the endpoint on Ray Serve, or in this process with address="" (see
    `workbench.serve.deploy.serve`)."""
    from workbench.serve.deploy import serve as start

    return start(*args, **kwargs)


def shutdown(endpoint=None, disconnect: bool = False) -> None:
    """Stop the endpoint: its in-process server, or Ray Serve's application (see
    `workbench.serve.deploy.shutdown`)."""
    from workbench.serve.deploy import shutdown as stop

    stop(endpoint, disconnect)
