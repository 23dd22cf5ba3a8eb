"""Our sampler behind the engine protocol (`policy.engine.Engine`): `engine.name=transformers`.

    engine = TransformersEngine(lm)                # lm: the host's loaded model (CPU or GPU)
    rows = engine.open(prompts_P, n)
    completions_B = rows.decode(params, generator)

A weights version is copied into the host's model by the session, so the version hooks do
nothing here. With `engine.cuda_graphs` on a CUDA device the host samples through
`sampler.graphs.GraphEngine` instead, the same rows over a static KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workbench.policy.engine import Completion, SamplingParams, StepRow, play_lockstep
from workbench.policy.stream import Stream, chat_format
from workbench.sampler.batch import LiveBatch, decode, extend, open_batch, repeat_rows, select_rows


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

    def play_rows(self, prompts_P: list[Stream], n: int, params: SamplingParams,
                  generator: torch.Generator | None, step_row: StepRow) -> None:
        """All live rows a turn at a time, from one batched KV cache (`play_lockstep`)."""
        play_lockstep(self, prompts_P, n, params, generator, step_row)

    def add_version(self, version: int, model: Any) -> None:
        """Nothing to do: the session copies a version's weights into the model itself."""

    def use_version(self, version: int, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Nothing to do: the model already holds the version's weights."""

    def drop_version(self, version: int) -> None:
        """Nothing to do."""

    def close(self) -> None:
        """Nothing to do: the model is the session's."""


