"""The engine protocol: one seam between the rollout loop and whatever draws the tokens, with the
records both sides share (SamplingParams, Completion, EngineSettings) and the context length.

The multi-turn loop (`rl.rollout.play_model`) and the session's `sample` drive an engine through
a batch of live rows, and nothing else:

    rows = engine.open(prompts_P, n)            # P prompt streams, each repeated n times: B rows
    completions_B = rows.decode(params, generator)
    rows.advance(keep, streams_B)               # keep rows `keep` (by position); streams_B are
                                                # their grown streams (reply + next observation)

A multi-turn rollout hands the engine its per-row step instead, and the engine decides when each
row samples (`Engine.play_rows`):

    engine.play_rows(prompts_P, n, params, generator, step_row)
    # step_row(b, completion) -> row b's next prompt, or None once its episode is over

`play_lockstep` is the one way every engine can do it: all live rows sample one reply per turn
together. The vLLM engine instead sends each row's next turn as soon as that row is back
(`engine.stream_rows`), so no row waits for the batch's slowest one and the environment steps
while vLLM samples the other rows.

Two engines stand behind it, picked by `engine.name` (`workbench.engines.make_engine`):
- `transformers` (default, CPU and GPU): our KV-cached batched sampler (`workbench.sampler`) over
  the host's model; a weights version is copied into that model by the session, so the version
  hooks do nothing here.
- `vllm` (GPU only, `workbench.vllm`): vLLM with prefix caching; each version's LoRA adapter is
  exported as a PEFT folder and sent as a LoRARequest, or merged into vLLM's own weights.

The version hooks (`add_version`, `use_version`, `drop_version`) are called by the session when
it snapshots, selects and prunes sampler weight versions. An engine with `samples_own_weights`
(vLLM) never reads the model's LoRA while it samples, so an in-process session runs its sampling
calls on a lane of their own, beside the trainer's (`session.inprocess.Session`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from workbench.policy.stream import Stream


@dataclass(frozen=True)
class SamplingParams:
    """How replies are drawn."""

    max_tokens: int = 8  # reply length cap (a move is one token in the tiny vocabulary)
    temperature: float = 1.0  # 0 = greedy (argmax)


@dataclass(frozen=True)
class Completion:
    """One sampled reply."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" (emitted <|im_end|>) or "length"


class DeadlineExceeded(TimeoutError):
    """Decoding passed its deadline; `tokens` replies' tokens were drawn by then (per row)."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"the deadline passed after {tokens} decode step(s)")
        self.tokens = tokens


@dataclass(frozen=True)
class EngineSettings:
    """The sampler's knobs (the `engine.*` keys of a run): which engine a model host builds
    (`workbench.engines`), vLLM's settings, and our sampler's CUDA fast paths."""

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
    stream_rows: bool = True
    """vllm only: each episode's next turn goes to vLLM as soon as its reply is back and its
    environment has stepped, while vLLM samples the other rows (no wait for the whole batch
    each turn); false: one LLM.generate per turn over every live row. Sampling seeds are drawn
    per row and turn, so a rollout does not depend on the order replies come back in."""
    vllm_lora: str = "adapter"
    """How the vllm engine samples a LoRA weights version: adapter (a PEFT folder per version,
    vLLM's LoRA kernels beside each projection; many versions side by side) | merged (vLLM built
    without LoRA; each version merged into its own weights, W + scale * B @ A in bf16, sent over
    CUDA IPC: no LoRA cost, one version at a time; `vllm.merged`)."""
    vllm_kv_cache_gb: float = 0.0
    """vllm only: vLLM's KV cache in GiB, set directly (vLLM's kv_cache_memory_bytes), instead of
    what gpu_memory_utilization leaves once vLLM has measured its own use at start: 0 =
    measured. That measurement reads the whole GPU's free memory, so it fails ("No available
    memory for the cache blocks", "Error in memory profiling") when other processes on the GPU
    allocate or free memory meanwhile (make test-gpu runs its paths side by side)."""
    vllm_fp8: bool = False
    """vllm only: vLLM runs the text and vision linear layers in FP8 (its online per-tensor
    quantisation of the bf16 weights, `quantization="fp8"`): the prefill's matrix products and
    the decode's weight reads about halve. With vllm_lora=merged each version is quantised again
    as it arrives (vLLM's layerwise reload); with adapter the base is quantised once and the
    LoRA kernels stay bf16. The sampler's log-probs then drift further from the trainer's: use
    algorithm.tis_cap (benchmarks/RESULTS.md, "A step")."""
    cuda_graphs: bool = False
    """transformers engine on a CUDA device: decode steps replayed as CUDA graphs over a KV pool
    sized for the rollout (`sampler.graphs`). Ignored on CPU and by the vllm engine; the
    knobs below go with it."""
    gqa_decode: bool = True
    """With cuda_graphs: one-token decode steps read each grouped-query KV head once."""
    kv_rows: int = 0
    """Rows the KV pool is sized for (0 = P x G of the run's rollout; 64 outside a run)."""
    kv_tokens: int = 2048
    """Tokens per row the KV pool is sized for (grown if an episode needs more)."""
    bucket: int = 256
    """Decode attention window granularity: one CUDA graph per bucket."""
    fused_decode: bool = True
    """With cuda_graphs: decode steps read the sampler's own copy of the text weights with the
    LoRA adapter merged in and q/k/v and gate/up fused (4 GEMMs a layer instead of 7 plus peft's
    LoRA kernels), re-merged when the sampler's weights version changes (`sampler.fused`). Costs
    the text matrices once more in GPU memory, and W + BA rounded to bf16 makes the sampler's
    log-probs differ from the trainer's about 4x more than unmerged LoRA."""
    compile_decode: bool = False
    """With fused_decode: torch.compile each layer's decode step before it is captured; a
    compile failure falls back to the eager step and says why."""


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


def uses_cuda_graphs(settings: EngineSettings, device: str) -> bool:
    """Whether a host samples through CUDA graphs (`sampler.graphs.GraphEngine`):
    engine.cuda_graphs, with the transformers engine, on a CUDA device."""
    return settings.cuda_graphs and settings.name == "transformers" and device.startswith("cuda")


StepRow = Callable[[int, Completion], "Stream | None"]
"""A rollout's step of one row: row b's reply in, the row's next prompt out (its stream grown by
the reply and the next observation), or None once the row's episode is over."""


class Engine(Protocol):
    """A sampler engine: opens batches of rows, plays multi-turn rows; follows the session's
    weight versions."""

    name: str
    samples_own_weights: bool  # samples from its own copy of each version, never the model's

    def open(self, prompts_P: list[Stream], n: int) -> Rows:
        """Rows for P prompts, each repeated n times (row p * n + g is sample g of prompt p)."""
        ...

    def play_rows(self, prompts_P: list[Stream], n: int, params: SamplingParams,
                  generator: torch.Generator | None, step_row: StepRow) -> None:
        """Sample every row of `open(prompts_P, n)` turn after turn, handing each reply to
        `step_row` and sampling the prompt it returns next, until it returns None for every
        row."""
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


DEFAULT_MAX_LEN = 16384
"""The context an engine or endpoint serves when none is set (and the model's own is longer): an
8B-shape episode (15 turns) holds about 2,500 tokens, and vLLM refuses to start unless one
request of its max_model_len fits its KV share."""


def model_max_len(config: Any) -> int:
    """The model's context limit: its (text) config's max_position_embeddings."""
    return int(getattr(config, "text_config", config).max_position_embeddings)


def context_len(asked: int, model_len: int) -> int:
    """The context served, in tokens (prompt + reply): `asked` (a max_model_len setting), else
    the model's own up to DEFAULT_MAX_LEN; a ValueError above the model's own."""
    length = asked or min(model_len, DEFAULT_MAX_LEN)
    if length > model_len:
        raise ValueError(f"max_model_len {length} is above the model's max_position_embeddings "
                         f"{model_len}: use {model_len} or less (0: the model's own)")
    return length


def extends(prompt: Stream, last: Stream) -> bool:
    """Whether `prompt` is `last` with tokens appended (an engine's cached rows can go on)."""
    return len(prompt) >= len(last) and prompt.tokens_T[:len(last)] == last.tokens_T


def play_lockstep(engine: Engine, prompts_P: list[Stream], n: int, params: SamplingParams,
                  generator: torch.Generator | None, step_row: StepRow) -> None:
    """`Engine.play_rows` by turns: every live row samples one reply (`Rows.decode`), each goes
    through `step_row`, the finished rows are dropped and the rest advance by their new tokens;
    when a new prompt is not its last one grown (an image window cut an older image) the live
    rows are opened anew from their prompts."""
    rows = engine.open(prompts_P, n)
    live_B = list(range(len(prompts_P) * n))  # live_B[b]: the row id at batch position b
    last_B = [p for p in prompts_P for _ in range(n)]
    while live_B:
        done_B = rows.decode(params, generator)
        grown = [(b, prompt) for b, (i, done) in enumerate(zip(live_B, done_B))
                 if (prompt := step_row(i, done)) is not None]
        if not grown:
            return
        keep, grown_B = [b for b, _ in grown], [prompt for _, prompt in grown]
        if all(extends(prompt, last_B[b]) for b, prompt in grown):
            rows.advance(keep, grown_B)
        else:
            rows = engine.open(grown_B, 1)
        live_B, last_B = [live_B[b] for b in keep], grown_B
