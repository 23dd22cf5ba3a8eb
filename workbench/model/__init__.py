"""Qwen3-VL policy models: the tiny default, local folders or hub ids, and LoRA."""

from workbench.model.load import (
    LoadedModel,
    folder_hash,
    load_model,
    resolve_model_path,
    weights_hash,
)
from workbench.model.lora import LoraSettings, add_lora, load_adapter
from workbench.model.tiny import TINY_NAME, TinySpec, build_tiny, tiny_path

__all__ = [
    "LoadedModel", "LoraSettings", "TINY_NAME", "TinySpec", "add_lora", "build_tiny",
    "folder_hash", "load_adapter", "load_model", "resolve_model_path", "tiny_path", "weights_hash",
]
