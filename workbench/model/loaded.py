"""The record a loaded policy travels in (`load_model`, `presets.build_random`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LoadedModel:
    """A model with its processor and where it came from."""

    model: Any  # Qwen3VLForConditionalGeneration (or a PeftModel around it)
    processor: Any  # Qwen3VLProcessor
    source: str  # what the user asked for ("tiny", a folder or a hub id)
    path: str  # the folder or hub id actually loaded
