"""What merging the LoRA adapter into bf16 weights costs in sampler/trainer agreement (CPU, bf16).

    OMP_NUM_THREADS=2 python -m benchmarks.merge_precision     # ~15 s on 2 cores

The fused decode path (`engine.fused_decode`, `sampler/fused.py`) folds the adapter into a
bf16 copy of each weight: W + s B A is rounded once to W's bf16 grid. The trainer (and the
unfused sampler) computes x W and s (x A) B separately. Once the adapter is non-zero, the two
differ by that rounding: up to half a bf16 step of W per element, whatever the adapter's size.
For growing adapter sizes (B ~ N(0, scale)), this prints the mean and max |delta log-prob|
between the eager sampler (transformers + peft) and each static path (unfused, fused), over
the tokens where both drew the same token. Small Qwen3-VL shape, bf16, LoRA r8, same seeds.

Answers: What does merging the adapter into bf16 weights cost in sampler/trainer agreement?
Figures: benchmarks/RESULTS.md, "Sampler against trainer: log-probs".
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.envs import MazeConfig, MazeEnv
from workbench.model import LoraSettings, add_lora
from workbench.model.presets import build_random
from workbench.policy import (
    SamplingParams,
    Stream,
    append_reply,
    append_user,
    chat_format,
    start_stream,
)
from workbench.rl.rollout import observe
from workbench.sampler.engine import TransformersEngine
from workbench.sampler.graphs import GraphEngine, make_static_decode


def maze_prompts(lm: Any, sizes: tuple[int, ...] = (9, 11)) -> list[Stream]:
    """The first prompt of maze k (seed k) of each size, as a rollout builds it
    (`rl.rollout.observe`; the GPU-path tests share them)."""
    fmt = chat_format(lm.processor)
    out = []
    for k, size in enumerate(sizes):
        config = MazeConfig(size=size, px_per_cell=25)
        obs, info = MazeEnv(config).reset(seed=k)
        out.append(observe(start_stream(lm.processor, fmt, config.rules()), lm.processor, fmt,
                           obs, info, config))
    return out


def rollout_like(engine: Any, prompts: list[Stream], n: int, turns: int, seed: int
                 ) -> list[list[Any]]:
    """A few turns of decode + advance with fixed follow-up text (no env), one row dropped a
    turn: each turn's completions (the GPU-path tests share it)."""
    fmt = chat_format(engine.lm.processor)
    rows = engine.open(prompts, n)
    streams = [s for s in prompts for _ in range(n)]
    out = []
    gen = torch.Generator().manual_seed(seed)
    for turn in range(turns):
        done = rows.decode(SamplingParams(max_tokens=5, temperature=1.0), gen)
        out.append(done)
        streams = [append_user(append_reply(s, fmt, c.tokens, c.logprobs), engine.lm.processor,
                               fmt, f"turn {turn}") for s, c in zip(streams, done)]
        keep = [b for b in range(len(streams)) if b != turn]
        streams = [streams[b] for b in keep]
        rows.advance(keep, streams)
    return out


def logprob_gaps(a_turns: list, b_turns: list) -> list[float]:
    """|log p_a - log p_b| over every token where both rollouts drew the same reply."""
    return [abs(x - y) for ta, tb in zip(a_turns, b_turns) for ca, cb in zip(ta, tb)
            if ca.tokens == cb.tokens for x, y in zip(ca.logprobs, cb.logprobs)]


def main() -> None:
    lm = build_random("qwen3-vl-small-shape", dtype=torch.bfloat16, device="cpu")
    lm.model = add_lora(lm.model, LoraSettings(rank=8, alpha=16)).eval()
    prompts = maze_prompts(lm)
    lora_B = [p for n, p in lm.model.named_parameters() if "lora_B" in n]
    print("B scale | static, unfused: mean / max |dlogp| | fused (merged bf16): mean / max")
    for scale in (0.0, 1e-4, 1e-3, 1e-2, 3e-2):
        with torch.no_grad():
            for k, p in enumerate(lora_B):
                p.normal_(0, 1, generator=torch.Generator().manual_seed(k)).mul_(scale)
        eager = rollout_like(TransformersEngine(lm), prompts, 2, 2, seed=7)
        cells = []
        for fused in (False, True):
            static = make_static_decode(lm.model, rows=4, capacity=64, bucket=32,
                                        use_graphs=False, fused=fused)
            gaps = logprob_gaps(eager, rollout_like(GraphEngine(lm, static), prompts, 2, 2,
                                                     seed=7))
            cells.append(f"{sum(gaps) / len(gaps):.2e} / {max(gaps):.2e}")
        print(f"{scale:7g} | {cells[0]} | {cells[1]}")


if __name__ == "__main__":
    main()
