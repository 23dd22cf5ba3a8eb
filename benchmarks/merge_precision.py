"""What merging the LoRA adapter into bf16 weights costs in sampler/trainer agreement (CPU, bf16).

    OMP_NUM_THREADS=2 python -m benchmarks.merge_precision     # ~15 s on 2 cores

The fused decode path (`speed.fused_decode`, `policy/fused.py`) folds the adapter into a
bf16 copy of each weight: W + s B A is rounded once to W's bf16 grid. The trainer (and the
unfused sampler) computes x W and s (x A) B separately. Once the adapter is non-zero, the two
differ by that rounding: up to half a bf16 step of W per element, whatever the adapter's size.
For growing adapter sizes (B ~ N(0, scale)), this prints the mean and max |delta log-prob|
between the eager sampler (transformers + peft) and each static path (unfused, fused), over
the tokens where both drew the same token. Small Qwen3-VL shape, bf16, LoRA r8, same seeds.
"""

from __future__ import annotations

import torch

from tests.test_gpu_paths import _prompts, _rollout_like
from workbench.model import LoraSettings, add_lora
from workbench.model.presets import build_random
from workbench.policy.engine import TransformersEngine
from workbench.policy.graphs import GraphEngine, make_static_decode


def logprob_gaps(a_turns: list, b_turns: list) -> list[float]:
    """|log p_a - log p_b| over every token where both rollouts drew the same reply."""
    return [abs(x - y) for ta, tb in zip(a_turns, b_turns) for ca, cb in zip(ta, tb)
            if ca.tokens == cb.tokens for x, y in zip(ca.logprobs, cb.logprobs)]


def main() -> None:
    lm = build_random("qwen3-vl-small-shape", dtype=torch.bfloat16, device="cpu")
    lm.model = add_lora(lm.model, LoraSettings(rank=8, alpha=16)).eval()
    prompts = _prompts(lm)
    lora_B = [p for n, p in lm.model.named_parameters() if "lora_B" in n]
    print("B scale | static, unfused: mean / max |dlogp| | fused (merged bf16): mean / max")
    for scale in (0.0, 1e-4, 1e-3, 1e-2, 3e-2):
        with torch.no_grad():
            for k, p in enumerate(lora_B):
                p.normal_(0, 1, generator=torch.Generator().manual_seed(k)).mul_(scale)
        eager = _rollout_like(TransformersEngine(lm), prompts, 2, 2, seed=7)
        cells = []
        for fused in (False, True):
            static = make_static_decode(lm.model, rows=4, capacity=64, bucket=32,
                                        use_graphs=False, fused=fused)
            gaps = logprob_gaps(eager, _rollout_like(GraphEngine(lm, static), prompts, 2, 2,
                                                     seed=7))
            cells.append(f"{sum(gaps) / len(gaps):.2e} / {max(gaps):.2e}")
        print(f"{scale:7g} | {cells[0]} | {cells[1]}")


if __name__ == "__main__":
    main()
