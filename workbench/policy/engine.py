"""Sampler engines: one seam between the rollout loop and whatever draws the tokens.

The multi-turn loop (`rl.rollout.play_model`) and the session's `sample` drive an engine through
a batch of live rows, and nothing else:

    rows = engine.open(prompts_P, n)            # P prompt streams, each repeated n times: B rows
    completions_B = rows.decode(params, generator)
    rows.advance(keep, streams_B)               # keep rows `keep` (by position); streams_B are
                                                # their grown streams (reply + next observation)

Two engines stand behind it, picked by `engine.name` (`policy.engines.make_engine`):
- `transformers` (default, CPU and GPU): our KV-cached batched sampler (`policy.sampler`) over the
  host's model; a weights version is copied into that model by the session, so the version hooks
  do nothing here.
- `vllm` (GPU only, `policy.vllm_engine`): vLLM with prefix caching; each version's LoRA adapter
  is exported as a PEFT folder and sent as a LoRARequest, or merged into vLLM's own weights.

The version hooks (`add_version`, `use_version`, `drop_version`) are called by the session when
it snapshots, selects and prunes sampler weight versions. An engine with `samples_own_weights`
(vLLM) never reads the model's LoRA while it samples, so an in-process session runs its sampling
calls on a lane of their own, beside the trainer's (`session.inprocess.Session`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from workbench.policy.sampler import (
    Completion,
    LiveBatch,
    SamplingParams,
    decode,
    extend,
    open_batch,
    repeat_rows,
    select_rows,
)
from workbench.policy.stream import Stream, chat_format


@dataclass(frozen=True)
class EngineSettings:
    """Which sampler engine a model host builds, and the GPU engine's knobs."""

    name: str = "transformers"
    """Sampler engine: transformers (our KV-cached sampler; CPU and GPU) | vllm (GPU only, needs
    the vllm package; prefix caching, LoRA adapters loaded by version). SkyRL:
    generator.backend."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory a sampler engine may use (GPU engines only; ignored on CPU)."""
    max_images: int = 0
    """Images per prompt vLLM makes room for (0 = one per turn of generator.max_turns; 16
    outside a run)."""
    max_model_len: int = 0
    """vLLM's context length in tokens: 0 = the model's max_position_embeddings, at most 16384
    (a 15-turn seed-shape episode holds about 2,500 tokens; Qwen3-VL-8B allows 262,144, whose KV
    for one request alone would take 36 GiB). Above the model's own limit: an error."""
    seed: int = 0
    """vLLM's engine seed (each request also gets a seed from the rollout's generator)."""
    vllm_lora: str = "adapter"
    """How the vllm engine samples a LoRA weights version: adapter (a PEFT folder per version,
    vLLM's LoRA kernels beside each projection; many versions side by side) | merged (vLLM built
    without LoRA; each version merged into its own weights, W + scale * B @ A in bf16, sent over
    CUDA IPC: no LoRA cost, one version at a time; `policy.vllm_merged`)."""


class Rows(Protocol):
    """A batch of live rows inside an engine (one per episode still playing)."""

    def decode(self, params: SamplingParams,
               generator: torch.Generator | None = None) -> list[Completion]:
        """One reply per row: completions_B."""
        ...

    def advance(self, keep: list[int], streams_B: list[Stream]) -> None:
        """Keep rows `keep` (positions in the current batch); streams_B[b] is kept row b's
        stream, grown by the reply and the next observation."""
        ...


class Engine(Protocol):
    """A sampler engine: opens batches of rows; follows the session's weight versions."""

    name: str
    samples_own_weights: bool  # samples from its own copy of each version, never the model's

    def open(self, prompts_P: list[Stream], n: int) -> Rows:
        """Rows for P prompts, each repeated n times (row p * n + g is sample g of prompt p)."""
        ...

    def add_version(self, version: int, model: Any) -> None:
        """`model` (the peft policy) now holds weights version `version`."""
        ...

    def use_version(self, version: int, tensors: dict[str, torch.Tensor] | None) -> None:
        """Sample from weights version `version` from now on (`tensors`: its snapshot of the
        trainable weights, None if the host has none)."""
        ...

    def drop_version(self, version: int) -> None:
        """Version `version` will not be used again."""
        ...

    def close(self) -> None:
        """Free what the engine holds outside this process's objects (vLLM: its engine core)."""
        ...


@dataclass
class TransformersRows:
    """Rows of the transformers engine: one batched KV cache (`LiveBatch`)."""

    engine: TransformersEngine
    live: LiveBatch

    def decode(self, params: SamplingParams,
               generator: torch.Generator | None = None) -> list[Completion]:
        """One reply per row from the cached state."""
        e = self.engine
        return decode(e.lm.model, self.live, e.fmt, params, generator)

    def advance(self, keep: list[int], streams_B: list[Stream]) -> None:
        """Drop the rows not kept, then prefill each kept row's new tokens."""
        select_rows(self.live, keep)
        extend(self.engine.lm.model, self.live, streams_B, self.engine.pad_id)


class TransformersEngine:
    """Our KV-cached batched sampler over `lm.model` (CPU or GPU)."""

    name = "transformers"
    samples_own_weights = False  # samples from the host's model: versions are copied into it

    def __init__(self, lm: Any) -> None:
        self.lm = lm  # read lm.model at each call: the session may re-wrap it
        self.fmt = chat_format(lm.processor)
        self.pad_id: int = lm.processor.tokenizer.pad_token_id

    def open(self, prompts_P: list[Stream], n: int) -> TransformersRows:
        """Prefill each prompt once, then share its cache among its n rows."""
        live = open_batch()
        extend(self.lm.model, live, prompts_P, self.pad_id)
        repeat_rows(live, n)
        return TransformersRows(self, live)

    def add_version(self, version: int, model: Any) -> None:
        """Nothing to do: the session copies a version's weights into the model itself."""

    def use_version(self, version: int, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Nothing to do: the model already holds the version's weights."""

    def drop_version(self, version: int) -> None:
        """Nothing to do."""

    def close(self) -> None:
        """Nothing to do: the model is the session's."""


