"""Sampler (vLLM) vs trainer log-probs at a model shape, on a CUDA machine with vLLM: a short
rollout of the seed's mazes through `generator.engine=vllm`, then the trainer re-scores every
sampled reply token with the same weights (bf16 both sides). Prints one line of figures.

    python3 benchmarks/vllm_agreement.py --shape qwen3-vl-8b-shape   # random 8B weights
    python3 benchmarks/vllm_agreement.py --model /path/to/folder      # any saved checkpoint

A shape is built with random weights and saved to --folder first (vLLM loads from disk).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path


def save_shape(shape: str, folder: Path, device: str = "cuda", dtype: str = "bfloat16") -> str:
    """Random weights of `shape` saved as a checkpoint folder (vLLM loads from disk; kept when
    already there) -> the folder. The other GPU benchmarks (side_by_side, serve_bench) use it."""
    import torch

    from workbench.model import load_model

    if not (folder / "config.json").is_file():
        lm = load_model(shape, dtype=getattr(torch, dtype), device=device)
        lm.model.save_pretrained(folder, max_shard_size="5GB")
        lm.processor.save_pretrained(folder)
        del lm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-vl-8b-shape")
    parser.add_argument("--model", default="", help="a checkpoint folder (instead of --shape)")
    parser.add_argument("--folder", default="/tmp/vllm-shape")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--memory", type=float, default=0.5, help="vLLM's GPU memory share")
    parser.add_argument("--mazes", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--fp32-baseline", action="store_true",
                        help="then score the same tokens with the base in float32: how far each "
                             "bf16 side (vLLM, trainer) is from it")
    args = parser.parse_args()

    from workbench.config import PRESETS
    from workbench.envs import eval_set
    from workbench.model import LoraSettings
    from workbench.policy import SamplingParams
    from workbench.policy.engine import EngineSettings
    from workbench.rl.rollout import play_episodes
    from workbench.session import SessionSpec, create_session

    t0 = time.perf_counter()
    model = args.model
    if not model:
        save_shape(args.shape, Path(args.folder))
        model = args.folder
    maze = PRESETS["seed_gpu"].task
    spec = SessionSpec(model, LoraSettings(rank=args.rank, alpha=2 * args.rank),
                       workdir="/tmp/vllm-agreement", device="cuda", dtype="bfloat16",
                       engine=EngineSettings("vllm", gpu_memory_utilization=args.memory))
    session = create_session(spec)
    up_s = time.perf_counter() - t0
    try:
        sampler = session.training_client.save_weights_and_get_sampling_client()
        t1 = time.perf_counter()
        episodes = sampler.play(play_episodes, maze, eval_set(maze.size, args.mazes),
                                args.samples, SamplingParams(max_tokens=8), 0).result()
        rollout_s = time.perf_counter() - t1
        diffs, rescored_E = [], []
        for ep in (e for group in episodes for e in group):
            rescored = sampler.compute_logprobs(ep.stream).result()
            rescored_E.append(rescored)
            diffs += [abs(a - b) for a, b, m in
                      zip(ep.stream.logprobs_T, rescored, ep.stream.loss_mask_T) if m]
        turns = sum(ep.turns for g in episodes for ep in g)
        print(f"{args.model or args.shape}: bf16, LoRA r{args.rank}; {len(diffs)} reply tokens "
              f"over {turns} turns: sampler vs trainer log-prob max |diff| {max(diffs):.4f}, "
              f"median {statistics.median(diffs):.4f}, mean {statistics.fmean(diffs):.4f}; "
              f"session up in {up_s:.0f} s, rollout {rollout_s:.1f} s", flush=True)
    finally:
        session.close()
    if args.fp32_baseline:
        streams = [ep.stream for group in episodes for ep in group]
        fp32_baseline(model, streams, rescored_E)


def fp32_baseline(model: str, streams: list, rescored_E: list[list[float]]) -> None:
    """The base in float32 scores the same reply tokens (a fresh LoRA adds nothing): the
    distance of vLLM's and of the bf16 trainer's log-probs from it."""
    import torch

    from workbench.model import load_model
    from workbench.policy import chat_format
    from workbench.policy.forward import token_logprobs

    gc.collect()
    torch.cuda.empty_cache()
    lm = load_model(model, dtype=torch.float32, device="cuda")
    fmt = chat_format(lm.processor)
    pad = lm.processor.tokenizer.pad_token_id or 0
    vllm_d, trainer_d = [], []
    with torch.no_grad():
        for stream, rescored in zip(streams, rescored_E):
            logp, _ = token_logprobs(lm.model, [stream], 1.0, fmt.banned, pad)
            exact = logp[0].tolist()
            for t, m in enumerate(stream.loss_mask_T):
                if m:
                    vllm_d.append(abs(stream.logprobs_T[t] - exact[t]))
                    trainer_d.append(abs(rescored[t] - exact[t]))
    for name, d in (("vLLM bf16", vllm_d), ("trainer bf16", trainer_d)):
        print(f"{name} vs base fp32: max |diff| {max(d):.4f}, median {statistics.median(d):.4f}, "
              f"mean {statistics.fmean(d):.4f}", flush=True)


if __name__ == "__main__":
    main()
