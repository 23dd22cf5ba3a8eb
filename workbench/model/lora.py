"""LoRA on the language model's projections, through peft (rank 32 in the seed's recipe)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LANGUAGE_PROJECTIONS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)


VISION_LINEARS = (r"visual\.(blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])"
                  r"|merger\.linear_fc[12]|deepstack_merger_list\.\d+\.linear_fc[12])")
"""The vision tower's linear layers and its mergers (the patch embedding, a convolution, stays)."""


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapter shape: the language model's projections, and optionally the vision tower."""

    rank: int = 32
    """LoRA rank r (the seed uses 32)."""
    alpha: int = 64
    """LoRA alpha; the update is scaled by alpha / rank."""
    dropout: float = 0.0
    """LoRA dropout (0 keeps sampler and trainer log-probs identical)."""
    target_modules: tuple[str, ...] = LANGUAGE_PROJECTIONS
    """Projection names adapted in the text model, comma-separated."""
    init_seed: int = 0
    """Seed of the A matrices (B starts at zero)."""
    vision: bool = False
    """Also adapt the vision tower's linear layers and its merger (VISION_LINEARS). The tiny
    default's weakest part is its perception, so its runs adapt the vision tower too; the seed's
    8B recipe (seed_gpu) adapts the language model only."""

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> LoraSettings | None:
        """Inverse of dataclasses.asdict through JSON (lists back to tuples); None stays None."""
        if data is None:
            return None
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in data.items()}
        return cls(**fields)

    @property
    def target_regex(self) -> str:
        """peft regex selecting the targets: the language model's projections, and with
        `vision` the vision tower's linear layers too."""
        names = "|".join(self.target_modules)
        text = rf"language_model.*\.({names})"
        return rf".*({text}|{VISION_LINEARS})" if self.vision else rf".*{text}"


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


def adapted_layers(model: Any) -> tuple[Any, ...]:
    """peft's adapted layers of a model: those whose input cast `lora_in_model_dtype` switches
    off (the flag peft's own disable_input_dtype_casting switches)."""
    return tuple(m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled"))


@contextmanager
def lora_in_model_dtype(model: Any, on: bool = True, adapted: Sequence[Any] | None = None
                        ) -> Iterator[None]:
    """Compute the LoRA adapters in the base model's dtype (bf16) instead of peft's float32 path.

    peft casts each adapted layer's input to the adapter's dtype (float32) before A and B: at
    40 k tokens a forward_backward call that is seven float32 copies of the activations a layer,
    forward and backward. Inside this context that cast is off and autocast runs A and B in the
    base dtype; the adapter weights, their gradients and Adam's state stay float32 (mixed
    precision, as with HF Trainer's bf16=True). A no-op when `on` is false or the base model is
    float32 (the CPU default). `adapted`: the model's adapted layers (`adapted_layers`) listed
    once, so each call switches them without walking the module tree (3,367 modules at the 8B
    shape)."""
    import torch

    first = next(model.parameters())
    if not on or first.dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    adapted = adapted_layers(model) if adapted is None else adapted
    casts = [m.cast_input_dtype_enabled for m in adapted]
    for m in adapted:
        m.cast_input_dtype_enabled = False
    try:
        with torch.autocast(first.device.type, dtype=first.dtype):
            yield
    finally:
        for m, cast in zip(adapted, casts):
            m.cast_input_dtype_enabled = cast


def merged_weight(linear: Any, factors: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
                  ) -> torch.Tensor:
    """`linear`'s weight with its active LoRA adapters folded in (peft's LoRA Linear or a plain
    nn.Linear), computed in float32 and rounded once to the weight's dtype. `factors` (adapter
    -> (A, B)) replaces the adapters' own factors: a snapshot of another weights version."""
    base = getattr(linear, "base_layer", linear)
    W = base.weight.detach()
    adapters = [] if getattr(linear, "disable_adapters", True) or getattr(linear, "merged", False) \
        else [a for a in linear.active_adapters if a in linear.lora_A]
    if not adapters:
        return W
    out = W.float()
    for a in adapters:
        if a in getattr(linear, "lora_variant", {}):
            raise ValueError(f"merged weights take plain LoRA only; adapter {a!r} is a variant "
                             "(DoRA, ...): set engine.fused_decode=false (our engine) or "
                             "engine.vllm_lora=adapter (vLLM)")
        A, B = factors[a] if factors is not None else (linear.lora_A[a].weight,
                                                        linear.lora_B[a].weight)
        out = torch.addmm(out, B.detach().float(), A.detach().float(), alpha=linear.scaling[a])
    return out.to(W.dtype)
