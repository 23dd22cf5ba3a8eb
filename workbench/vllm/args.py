"""vLLM's set-up, written once for the sampler engine and the endpoint's replica: the import with
its install hint, the context length, the memory share, and the engine arguments.

    vllm = import_vllm()                                  # ImportError naming the extra
    kwargs = engine_kwargs(path, settings, lora_rank=32, dtype="bfloat16", max_model_len=4096)
    llm = vllm.LLM(**kwargs)                              # or vllm.AsyncEngineArgs(**kwargs)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from workbench.deps import require
from workbench.policy.engine import EngineSettings, context_len
from workbench.vllm.merged import WORKER_EXTENSION

INSTALL_HINT = (
    "{what} needs the vllm package (GPU only, CUDA): pip install vllm==0.26.0 "
    "(or pip install 'workbench[gpu]'; it pins torch==2.11.0, the version tested). "
    "On a CPU machine use {instead}."
)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # max_lora_rank values vLLM accepts


def import_vllm(what: str = "engine.name=vllm", instead: str = "engine.name=transformers"
                ) -> ModuleType:
    """The vllm module, or an ImportError naming the package, what asked for it (a config key
    or a serve setting) and what to use instead."""
    try:
        return require("vllm")
    except ImportError as err:
        raise ImportError(INSTALL_HINT.format(what=what, instead=instead)) from err


def max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
    return fits[0]


LORA_DTYPES = ("bfloat16", "float16")
"""The dtypes vLLM's LoRA kernels take (they assert it at the first LoRA request)."""


def checked_max_len(settings: EngineSettings, dtype: str, model_len: int) -> int:
    """vLLM's max_model_len for this model (`policy.engine.context_len` of
    settings.max_model_len), or a one-line error for settings vLLM would refuse (or a LoRA dtype
    its kernels assert on)."""
    if dtype not in LORA_DTYPES:
        raise ValueError(f"engine.name=vllm samples LoRA adapters, and vLLM's LoRA kernels "
                         f"take {' or '.join(LORA_DTYPES)} only, not {dtype}: set "
                         "model.dtype=bfloat16")
    return context_len(settings.max_model_len, model_len)


def check_memory_share(share: float, free_bytes: int, total_bytes: int) -> None:
    """vLLM takes `share` of the whole GPU at start and fails in its engine process (the error
    buried in its log) when less is free: say so here, in one line with the key to change."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"engine.gpu_memory_utilization must be in (0, 1), not {share}")
    if share * total_bytes > free_bytes:
        asked, total, free = share * total_bytes / 2**30, total_bytes / 2**30, free_bytes / 2**30
        raise ValueError(
            f"engine.gpu_memory_utilization {share} asks vLLM for {asked:.1f} GiB of the GPU's "
            f"{total:.0f} GiB, but only {free:.1f} GiB is free (the trainer's weights, an engine "
            "of a session still open, e.g. the one train(config) returns: close it with "
            "`.session.close()`, other processes): use "
            f"{int(100 * free / total) / 100 - 0.01:.2f} or less")


def engine_kwargs(model_path: str, settings: EngineSettings, lora_rank: int,
                  dtype: str, max_model_len: int) -> dict[str, Any]:
    """Keyword arguments of vllm.LLM for a LoRA sampler of `model_path`: with LoRA kernels
    (vllm_lora=adapter) or without, the worker taking merged weights (vllm_lora=merged)."""
    lora: dict[str, Any] = (
        {"worker_extension_cls": WORKER_EXTENSION} if settings.vllm_lora == "merged" else
        {"enable_lora": True, "max_lora_rank": max_lora_rank(lora_rank), "max_loras": 1})
    return dict(
        model=model_path, tokenizer=model_path, dtype=dtype, seed=settings.seed,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enable_prefix_caching=True,  # multi-turn prefixes and the G rows of a maze are reused
        **lora,
        **({"quantization": "fp8"} if settings.vllm_fp8 else {}),
        **({"kv_cache_memory_bytes": int(settings.vllm_kv_cache_gb * 2**30)}
           if settings.vllm_kv_cache_gb else {}),
        max_model_len=max_model_len,
        limit_mm_per_prompt={"image": settings.max_images or 16},
        logprobs_mode="processed_logprobs",  # log-probs of the distribution sampled from
        disable_log_stats=False,  # keeps the prefix-cache counters (VLLMEngine.cache_metrics)
    )
