"""What a serving replica opens: the engine `ServeSettings.engine` names (one of
`workbench.engines.ENGINES`, the names training and evaluation use too).

    replica = open_replica(ServeSettings(model="tiny", adapters="s3://bucket/workbench"))

transformers: `serve.engine` (our sampler under a lock, CPU or GPU); vllm: `serve.vllm_async`
(vLLM's async engine, GPU only, built from `workbench.vllm.args`; vllm itself is imported only
when that engine opens).
"""

from __future__ import annotations

from workbench.serve.engine import Replica, ServeSettings, open_transformers_replica
from workbench.serve.vllm_async import open_vllm_replica


def open_replica(settings: ServeSettings) -> Replica:
    """The replica's state over the engine `settings.engine`."""
    if settings.engine == "vllm":
        return open_vllm_replica(settings)
    return open_transformers_replica(settings)
