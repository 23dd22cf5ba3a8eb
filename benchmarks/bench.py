"""Benchmarks (`make bench`): print medians; nothing here is asserted by tests.

- env: maze steps/s with rendering (image + ascii observation), one thread.
- sampling: tiny default, batch of 64 episodes of 7x7 mazes: prefill tokens/s of the first
  prompt and decode tokens/s (KV cache), plus a full 15-turn model rollout (turns/s).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from workbench.envs import MazeConfig, MazeEnv, eval_set
from workbench.model import load_model
from workbench.policy import (
    SamplingParams, append_user, chat_format, decode, encode_image, extend, open_batch,
    start_stream,
)
from workbench.rl import play_model


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_env(steps: int = 2000, repeats: int = 5) -> float:
    """Median env steps/s (7x7, 32 px, rendering every step)."""
    env, rng = MazeEnv(MazeConfig(size=7)), np.random.default_rng(0)
    words = ("up", "down", "left", "right")

    def run() -> None:
        env.reset(seed=1_000_000)
        for _ in range(steps):
            if env.done:
                env.reset(seed=int(rng.integers(1_000_000, 2_000_000)))
            env.step(words[int(rng.integers(4))])

    return steps / _median_time(run, repeats)


def bench_sampling(batch: int = 64, new_tokens: int = 8, repeats: int = 5) -> dict[str, float]:
    """Median prefill and decode tokens/s for `batch` first-turn prompts."""
    lm = load_model("tiny")
    fmt, pad = chat_format(lm.processor), lm.processor.tokenizer.pad_token_id
    config = MazeConfig(size=7)
    streams = []
    for state in eval_set(7, batch):
        env = MazeEnv(config)
        obs, info = env.reset(options={"init_state": state})
        s = start_stream(lm.processor, fmt, "You are in a maze.")
        streams.append(append_user(s, lm.processor, fmt, info["budget_text"],
                                   encode_image(lm.processor, obs["image"])))
    prompt_tokens = sum(len(s) for s in streams)
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0)
    fmt = fmt.__class__(**{**fmt.__dict__, "im_end": -1})  # never stop early: fixed decode length
    prefill, dec = [], []
    for r in range(repeats):
        live = open_batch()
        t0 = time.perf_counter()
        with torch.no_grad():
            extend(lm.model, live, streams, pad)
        t1 = time.perf_counter()
        decode(lm.model, live, fmt, params, torch.Generator().manual_seed(r))
        t2 = time.perf_counter()
        prefill.append(prompt_tokens / (t1 - t0))
        dec.append(batch * new_tokens / (t2 - t1))
    return {"prefill_tokens_per_s": statistics.median(prefill),
            "decode_tokens_per_s": statistics.median(dec), "prompt_tokens": prompt_tokens / batch}


def bench_rollout(mazes: int = 8, group: int = 8, repeats: int = 3) -> dict[str, float]:
    """Median seconds for a 15-turn rollout of mazes x group episodes (untrained model)."""
    lm = load_model("tiny")
    config, states = MazeConfig(size=7), eval_set(7, mazes)
    params = SamplingParams(max_tokens=2, temperature=1.0)
    turns = []

    def run() -> None:
        eps = play_model(lm, config, states, group, params, torch.Generator().manual_seed(0))
        turns.append(sum(e.turns for g in eps for e in g))

    seconds = _median_time(run, repeats)
    return {"rollout_s": seconds, "turns_per_s": statistics.median(turns) / seconds}


def main() -> None:
    torch.set_num_threads(1)
    print(f"env: {bench_env():,.0f} steps/s (7x7, 32 px, render every step, 1 thread)")
    torch.set_num_threads(2)
    s = bench_sampling()
    print(f"sampling (tiny, batch 64, 2 threads): prefill {s['prefill_tokens_per_s']:,.0f} "
          f"tokens/s ({s['prompt_tokens']:.0f}-token prompts), "
          f"decode {s['decode_tokens_per_s']:,.0f} tokens/s")
    r = bench_rollout()
    print(f"rollout (tiny, 8 mazes x 8 samples, 15 turns, 2-token replies, 2 threads): "
          f"{r['rollout_s']:.2f} s, {r['turns_per_s']:.0f} turns/s")


if __name__ == "__main__":
    main()
