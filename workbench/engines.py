"""The one registry of sampler engines, by name (`engine.name`; the endpoint's `--engine` takes
the same names): `make_engine` builds the one a host asks for, behind `policy.engine.Engine`.

    engine = make_engine(EngineSettings("transformers"), lm, lora_rank=8, adapter_root=folder)

transformers: our sampler (`workbench.sampler`), over CUDA graphs where `uses_cuda_graphs` says
so; vllm: `workbench.vllm` (GPU only; the vllm package is imported when the engine opens).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.policy.engine import Engine, EngineSettings, uses_cuda_graphs
from workbench.sampler.engine import TransformersEngine
from workbench.sampler.graphs import graph_engine
from workbench.vllm.engine import VLLMEngine

EngineBuilder = Callable[[Any, EngineSettings, int | None, Path], Engine]


def _transformers(lm: Any, settings: EngineSettings, lora_rank: int | None,
                  adapter_root: Path) -> Engine:
    if uses_cuda_graphs(settings, lm.model.device.type):
        return graph_engine(lm, settings)
    return TransformersEngine(lm)


def _vllm(lm: Any, settings: EngineSettings, lora_rank: int | None,
          adapter_root: Path) -> Engine:
    return VLLMEngine(lm, settings, lora_rank, adapter_root)


ENGINES: dict[str, EngineBuilder] = {"transformers": _transformers, "vllm": _vllm}


def make_engine(settings: EngineSettings, lm: Any, lora_rank: int | None,
                adapter_root: Path) -> Engine:
    """The engine `settings.name` over the loaded model `lm` (lora_rank None: full fine-tuning;
    adapter_root: where an engine that loads adapters from disk writes them)."""
    if settings.name not in ENGINES:
        raise ValueError(f"engine.name={settings.name!r} is not one of {sorted(ENGINES)}")
    return ENGINES[settings.name](lm, settings, lora_rank, Path(adapter_root))
