"""LoRA on the language model's projections, through peft (rank 32 in the seed's recipe)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

LANGUAGE_PROJECTIONS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapter shape; the vision tower is left frozen and un-adapted."""

    rank: int = 32  # LoRA rank r (the seed uses 32)
    alpha: int = 64  # LoRA alpha; the update is scaled by alpha / rank
    dropout: float = 0.0  # LoRA dropout (0 keeps sampler and trainer log-probs identical)
    target_modules: tuple[str, ...] = LANGUAGE_PROJECTIONS  # projection names in the text model
    init_seed: int = 0  # seed for the A matrices (B starts at zero)

    @property
    def target_regex(self) -> str:
        """peft regex selecting the targets inside the language model only."""
        names = "|".join(self.target_modules)
        return rf".*language_model.*\.({names})"


def add_lora(model: Any, settings: LoraSettings = LoraSettings()) -> Any:
    """Wrap `model` in a peft LoRA model; only adapter weights are trainable."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_regex,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):  # seeded A init without touching global RNG
        torch.manual_seed(settings.init_seed)
        return get_peft_model(model, config)


def load_adapter(model: Any, folder: str | Path, trainable: bool = False) -> Any:
    """Load a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) onto `model`."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(folder), is_trainable=trainable)
