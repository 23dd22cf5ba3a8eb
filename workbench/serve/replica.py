"""What a serving replica opens: the engine `ServeSettings.engine` names.

    engine = open_engine(ServeSettings(model="tiny", adapters="s3://bucket/workbench"))

transformers: `serve.engine` (our sampler under a lock, CPU or GPU); vllm: `serve.vllm_async`
(vLLM's async engine, GPU only; vllm itself is imported only when that engine opens).
"""

from __future__ import annotations

from collections.abc import Callable

from workbench.serve.engine import Engine, ServeSettings, open_transformers_engine
from workbench.serve.vllm_async import open_vllm_engine

OPENERS: dict[str, Callable[[ServeSettings], Engine]] = {
    "transformers": open_transformers_engine, "vllm": open_vllm_engine}


def open_engine(settings: ServeSettings) -> Engine:
    """The replica's engine of `settings.engine` (see OPENERS)."""
    return OPENERS[settings.engine](settings)
