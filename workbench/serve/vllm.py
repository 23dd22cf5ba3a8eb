"""The GPU path: the same adapters served by vLLM through Ray Serve LLM (where vLLM is
installed; it is not on the CPU machine, so this only builds the config there).

    config = llm_config(ServeSettings(model="Qwen/Qwen3-VL-8B-Instruct",
                                      adapters="s3://bucket/workbench", cache_size=16))
    app = build_vllm_app(config)          # needs vllm: ray.serve.llm.build_openai_app
    serve.run(app)

Ray Serve LLM downloads `<dynamic_lora_loading_path>/<name>/` on a replica's first request for
`<base>:<name>` and keeps `max_num_adapters_per_replica` of them (LRU), the same contract as the
CPU engine: the registry's `adapters/` prefix is that path.
"""

from __future__ import annotations

from typing import Any

from workbench.deps import require
from workbench.registry import ADAPTERS
from workbench.serve.engine import ServeSettings
from workbench.storage import is_s3


def llm_config(settings: ServeSettings, max_lora_rank: int = 32, max_model_len: int = 8192,
               gpu_memory_utilization: float = 0.9, images_per_prompt: int = 16) -> dict[str, Any]:
    """Keyword arguments of ray.serve.llm.LLMConfig for vLLM with dynamic LoRA loading."""
    if settings.adapters and not is_s3(settings.adapters):
        raise ValueError(f"Ray Serve LLM loads adapters from cloud storage only (s3://...), "
                         f"not {settings.adapters!r}")
    lora = {"dynamic_lora_loading_path": f"{settings.adapters.rstrip('/')}/{ADAPTERS}",
            "max_num_adapters_per_replica": settings.cache_size} if settings.adapters else None
    engine = {"dtype": "bfloat16" if settings.dtype == "float32" else settings.dtype,
              "max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization,
              "limit_mm_per_prompt": {"image": images_per_prompt}}
    if lora:
        engine |= {"enable_lora": True, "max_lora_rank": max_lora_rank,
                   "max_loras": settings.cache_size}
    config = {"model_loading_config": {"model_id": settings.base_id,
                                       "model_source": settings.model},
              "engine_kwargs": engine,
              "deployment_config": {"num_replicas": settings.num_replicas}}
    return config | ({"lora_config": lora} if lora else {})


def build_vllm_app(config: dict[str, Any]) -> Any:
    """Ray Serve LLM's OpenAI app over one LLMConfig (ImportError naming the gpu extra when
    vLLM is missing)."""
    require("vllm")
    from ray.serve.llm import LLMConfig, build_openai_app

    return build_openai_app({"llm_configs": [LLMConfig(**config)]})
