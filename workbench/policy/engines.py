"""The sampler engines by name (`engine.name`): `make_engine` builds the one a host asks for.

    engine = make_engine(EngineSettings("transformers"), lm, lora_rank=8, adapter_root=folder)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.policy.engine import Engine, EngineSettings, TransformersEngine
from workbench.policy.vllm_engine import VLLMEngine

EngineBuilder = Callable[[Any, EngineSettings, int | None, Path], Engine]

def _transformers(lm: Any, settings: EngineSettings, lora_rank: int | None,
                  adapter_root: Path) -> Engine:
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
