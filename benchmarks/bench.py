"""`make bench`: the CPU figures of the parts, printed (medians; no test asserts them).

- env: maze steps/s with rendering, one thread.
- sampling: prefill and decode tokens/s of 64 first-turn rows of the tiny default.
- step: the product's GRPO step in the demo shape (`benchmarks.gpu` on the CPU), per phase,
  and one evaluation of the 64 held-out mazes.
- update: one rollout's 64 episodes with each distinct image encoded once against every
  occurrence encoded, and with each maze's first prompt run once (speed.share_prefix).
- dynamic sampling: the demo's first 6 steps without and with algorithm.dynamic_sampling=2.
- AdamW: one step fused against the per-tensor loop.
- serving: the OpenAI endpoint on Ray Serve, requests/s and latency, with adapter switching.
- ray: the step in-process against a local Ray instance, and its rollout on 1 against 2 engines.
- glue: the workbench's own work in a rollout through vLLM at the 8B shape (8 mazes x 8 samples,
  15 turns, 8-token replies), with generation free: `rollout.play_model` over an engine that
  streams rows as `VLLMEngine.stream` does, builds each request's prompt (`vllm_prompt`) and
  answers at once.

    python -m benchmarks.bench                 # everything (make bench)
    python -m benchmarks.bench core serving    # some parts: core | serving | ray | glue

Answers: What do the parts cost on the CPU: the sampler, the update, a step, Ray? Figures:
benchmarks/RESULTS.md, "A step on the CPU".
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.gpu import bench, first_prompts, time_decode
from workbench.envs import MazeConfig, MazeEnv, eval_set
from workbench.model import load_model
from workbench.policy import SamplingParams


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_env(steps: int = 2000, repeats: int = 5) -> float:
    """Median env steps/s (9x9 at the default 16 px, rendering every step)."""
    env, rng = MazeEnv(MazeConfig(size=9)), np.random.default_rng(0)
    words = ("up", "down", "left", "right")

    def run() -> None:
        env.reset(seed=1_000_000)
        for _ in range(steps):
            if env.done:
                env.reset(seed=int(rng.integers(1_000_000, 2_000_000)))
            env.step(words[int(rng.integers(4))])

    return steps / _median_time(run, repeats)


def bench_sampling(batch: int = 64, new_tokens: int = 8) -> dict[str, float]:
    """Prefill and decode of `batch` first-turn rows of the tiny default (9x9 mazes), through
    the engine's rows as `benchmarks.gpu.time_decode` times every engine."""
    from workbench.sampler.engine import TransformersEngine

    lm = load_model("tiny")
    prompts = first_prompts(lm.processor, MazeConfig(size=9), batch)
    return time_decode(TransformersEngine(lm), prompts, 1, new_tokens, repeats=5) | {
        "prompt_tokens": sum(len(p) for p in prompts) / batch}


def bench_grpo_step(repeats: int = 3) -> dict[str, float]:
    """The product's GRPO step in the demo shape (8 mazes x 8 samples, 9x9, 15 turns, LoRA 32,
    2-token replies; `benchmarks.gpu`), then one evaluation of the 64 mazes: medians."""
    return bench(["--model", "tiny", "--device", "cpu", "--steps", str(repeats),
                  "--max-tokens", "2", "--eval", "eval.n_mazes=64", "eval.sampled_passes=0"],
                 log=lambda *_: None)


def _update_batch():
    """A tiny session (LoRA 32 with the vision tower) and the 64 datums of one rollout of the
    demo's shape (8 mazes x 8 samples), advantages by `algorithm.advantage=parity`."""
    from workbench.config import PRESETS
    from workbench.rl import phases
    from workbench.rl.schedule import step_mazes
    from workbench.session import SessionSpec, create_session

    config = PRESETS["tiny"]
    session = create_session(SessionSpec("tiny", config.lora,
                                         workdir="/tmp/workbench-bench"))
    sampler = session.training_client.save_weights_and_get_sampling_client()
    ro = phases.rollout(sampler, phases.Batch(config.task, step_mazes(config, 1), 8,
                                              SamplingParams(max_tokens=2, temperature=1.0), 0))
    adv = phases.advantages(phases.score(ro).rewards_P_G, "parity")
    return session, phases.make_datums(ro, adv)


def _update(tc, datums):
    """One PPO update of these datums (sequence-mean loss, a negligible learning rate)."""
    from workbench.rl import phases
    from workbench.session import AdamParams, LossConfig

    return phases.update(tc, datums, phases.UpdateSettings(
        "ppo", LossConfig(reduction="sequence_mean"), AdamParams(learning_rate=1e-6)))


def bench_distinct_images(repeats: int = 3) -> dict[str, float]:
    """Median seconds of the same update (8 mazes x 8 samples of one rollout, all 64 episodes,
    LoRA 32 with the vision tower) with each distinct image encoded once, and with every
    occurrence encoded (`forward.distinct` patched to find no two images equal)."""
    import workbench.policy.forward as forward

    session, datums = _update_batch()
    tc = session.training_client
    images = [img for d in datums for img in d.stream.images]
    out = {"images": len(images), "distinct_images": len(forward.distinct(images)[0])}
    original = forward.distinct
    every = (lambda imgs: (imgs, list(range(len(imgs)))))  # noqa: E731  no two images equal
    for label, fn in (("every_occurrence", every), ("distinct", original)):
        forward.distinct = fn
        try:
            out[label] = _median_time(lambda: _update(tc, datums), repeats)
        finally:
            forward.distinct = original
    session.close()
    return out


def bench_shared_prefix(repeats: int = 5) -> dict[str, float]:
    """Median seconds of the update of one rollout's 64 episodes (8 mazes x 8 samples, LoRA 32
    with the vision tower) with each maze's first prompt run once (speed.share_prefix) and
    run for every episode."""
    from dataclasses import replace

    session, datums = _update_batch()
    tc, host = session.training_client, session.host
    out = {"tokens": sum(len(d.stream) for d in datums),
           "prefix": datums[0].stream.loss_mask_T.index(1)}
    for label in ("every_episode", "shared", "every_episode", "shared"):  # alternated
        host.speed = replace(host.speed, share_prefix=label == "shared")
        seconds = _median_time(lambda: _update(tc, datums), repeats)
        out[label] = min(out.get(label, seconds), seconds)
    session.close()
    return out


def bench_dynamic_sampling(steps: int = 6) -> dict[str, dict[str, float]]:
    """The demo's first `steps` GRPO steps from tiny-sft (`demo.DEMO_OVERRIDES`), without and
    with algorithm.dynamic_sampling=2: median seconds a step, datums a step, groups rolled out."""
    import tempfile

    from workbench.demo import demo_config
    from workbench.rl.train import start, train_step

    out = {}
    for rounds in (0, 2):
        with tempfile.TemporaryDirectory() as folder:
            config = demo_config(Path(folder), overrides=(
                f"trainer.total_steps={steps}", f"algorithm.dynamic_sampling={rounds}",
                "trainer.ckpt_interval=0", "trainer.hf_save_interval=0",
                "trainer.keep_step_records=false"))
            trainer = start(config, log=lambda *_: None)
            try:
                rows = [train_step(trainer) for _ in range(steps)]
            finally:
                trainer.session.close()
        out[f"rounds_{rounds}"] = {k: statistics.median(r[key] for r in rows) for k, key in (
            ("step_s", "time/step"), ("datums", "update/datums"),
            ("groups", "rollout/groups_sampled"))}
    return out


def bench_optimizer(repeats: int = 20) -> dict[str, float]:
    """Median seconds of one AdamW step over every weight of the tiny model (what each step of
    the tiny-sft build and of `python -m workbench sft` pays): the per-tensor loop (torch's CPU
    default, the code before) against the fused kernel the session now uses."""
    from workbench.model import load_model

    model = load_model("tiny").model
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    out = {"parameters": float(sum(p.numel() for p in params))}
    for label, kwargs in (("loop", {"foreach": False}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(params, lr=1e-4, **kwargs)
        opt.step()  # allocate the moments outside the timing
        out[label] = _median_time(opt.step, repeats)
    return out


def _random_adapters(folder: Path, n: int, rank: int = 32) -> list[Path]:
    """n LoRA adapters on the tiny default with random B (untrained, but each one different)."""
    from workbench.model import LoraSettings
    from workbench.session import SessionSpec, create_session

    session = create_session(SessionSpec("tiny", LoraSettings(rank=rank, alpha=2 * rank),
                                         workdir=str(folder)))
    out, gen = [], torch.Generator().manual_seed(0)
    for k in range(n):
        with torch.no_grad():
            for name, p in session.host.trainable().items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        out.append(session.training_client.export(folder / f"a{k}", "adapter").result())
    session.close()
    return out


def bench_serving(requests: int = 64, concurrency: int = 8) -> dict[str, dict[str, float]]:
    """Requests/s with `concurrency` clients and median latency of one request at a time, of
    the endpoint (Ray Serve, 1 replica of 1 CPU, tiny default, adapter cache 2, LoRA r32) on
    9x9 first-turn prompts with an image and 4-token replies: the base; one adapter; two
    adapters alternating (switching between resident adapters); three rotating (every request
    loads one adapter and evicts another)."""
    import os
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from workbench import registry, storage
    from workbench.envs import system_prompt
    from workbench.rl.rollout import user_text
    from workbench.serve import deploy, image_data_url

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a loopback-only instance; no token file
    tmp = Path(tempfile.mkdtemp(prefix="workbench-bench-serve-"))
    store = storage.open_store(tmp / "store")
    for k, folder in enumerate(_random_adapters(tmp / "exports", 3)):
        registry.publish(store, folder, f"a{k}")
    endpoint = deploy.serve("tiny", adapters=store.root, replicas=1, port=8765, cache_size=2,
                            log=lambda *_: None)
    client = OpenAI(base_url=endpoint.base_url, api_key="none", max_retries=0)
    config = MazeConfig(size=9)
    env = MazeEnv(config)
    obs, info = env.reset(options={"init_state": eval_set(9, 1)[0]})
    messages = [{"role": "system", "content": system_prompt(config)}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_url(obs["image"])}},
        {"type": "text", "text": user_text(obs, info, config)}]}]

    def one(model: str) -> float:
        t0 = time.perf_counter()
        client.chat.completions.create(model=model, messages=messages, max_tokens=4, seed=0)
        return time.perf_counter() - t0

    scenarios = {"base": ["tiny"], "one adapter": ["tiny:a0"],
                 "2 adapters alternating": ["tiny:a0", "tiny:a1"],
                 "3 adapters rotating (cache 2)": ["tiny:a0", "tiny:a1", "tiny:a2"]}
    out = {}
    try:
        for name, models in scenarios.items():
            for m in models:
                one(m)  # warm-up
            calls = [models[k % len(models)] for k in range(requests)]
            latencies = [one(m) for m in calls[:requests // 2]]  # one request at a time
            t0 = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:  # `concurrency` clients at once
                list(pool.map(one, calls))
            out[name] = {"requests_per_s": requests / (time.perf_counter() - t0),
                         "median_latency_s": statistics.median(latencies)}
    finally:
        deploy.shutdown(disconnect=True)
    return out


def print_serving() -> None:
    """Run bench_serving and print its table."""
    v = bench_serving()
    print("serving (Ray Serve, 1 replica x 1 CPU, tiny, 9x9 prompt with image, 4-token replies;"
          " requests/s: 64 requests from 8 clients; latency: median of 32 one at a time):")
    for name, r in v.items():
        print(f"  {name:<30} {r['requests_per_s']:6.1f} requests/s, median latency "
              f"{1000 * r['median_latency_s']:5.0f} ms")


def bench_ray(steps: int = 3) -> dict[str, dict]:
    """The product's step of the demo shape (`bench_grpo_step`'s) in-process and on a local Ray
    instance (1 trainer + 1 engine colocated, 2 torch threads each, as in-process), then on Ray
    with 1 engine of 2 threads against 2 engines of 1 (its rollout)."""
    base = ["--model", "tiny", "--device", "cpu", "--steps", str(steps), "--max-tokens", "2",
            "--threads", "2"]
    ray = ["--backend", "ray", "cluster.num_cpus=2"]
    quiet = {"log": lambda *_: None}
    return {"in-process": bench(base, **quiet),
            "ray": bench(base + ray + ["cluster.threads_per_actor=2"], **quiet),
            "2 engines": bench(base + ray + ["cluster.num_engines=2", "cluster.colocate_all="
                                             "false", "cluster.threads_per_actor=1"], **quiet)}


def print_ray(steps: int = 3) -> None:
    """Run bench_ray and print its figures."""
    r = bench_ray(steps)
    local, ray_s = r["in-process"]["step_s"], r["ray"]["step_s"]
    print("GRPO step, demo shape (8 mazes x 8 samples, 9x9, 15 turns, LoRA 32, 2 threads), "
          f"median of {steps}: in-process {local:.2f} s, local Ray {ray_s:.2f} s "
          f"(overhead {100 * (ray_s / local - 1):+.1f}%)")
    for name, label in (("ray", "1 engine x 2 threads"), ("2 engines", "2 engines x 1 thread")):
        print(f"  rollout of 64 episodes on Ray, {label}: {r[name]['rollout_s']:.2f} s")


def print_core() -> None:
    """Every part of `make bench` but serving and Ray."""
    torch.set_num_threads(1)
    print(f"env: {bench_env():,.0f} steps/s (9x9, 16 px, render every step, 1 thread)")
    torch.set_num_threads(2)
    s = bench_sampling()
    print(f"sampling (tiny, batch 64, 2 threads): prefill {s['prefill_tokens_per_s']:,.0f} "
          f"tokens/s ({s['prompt_tokens']:.0f}-token prompts), "
          f"decode {s['decode_tokens_per_s']:,.0f} tokens/s")
    g = bench_grpo_step()
    print("GRPO step (demo shape: 8 mazes x 8 samples, 9x9, 15 turns, LoRA 32, 2 threads), "
          f"median s: step {g['step_s']:.2f}, rollout {g['rollout_s']:.2f}, update "
          f"{g['update_s']:.2f}, weight sync {g['weight_sync_s']:.3f}; eval (64 mazes greedy) "
          f"{g['eval_s']:.2f}")
    print(f"  sampled {g['sampled_tokens_per_s']:,.0f} reply tokens/s, update "
          f"{g['update_tokens_per_s']:,.0f} tokens/s, peak RSS {g['peak_rss_gb']:.2f} GB")
    d = bench_distinct_images()
    print(f"update of 64 episodes ({d['images']} images, {d['distinct_images']} distinct), "
          f"median s: every image encoded {d['every_occurrence']:.2f}, each distinct image once "
          f"{d['distinct']:.2f}")
    p = bench_shared_prefix()
    print(f"update of 64 episodes ({p['tokens']} tokens, a {p['prefix']}-token first prompt per "
          f"maze), better of two medians, s: every episode's prompt {p['every_episode']:.2f}, "
          f"each maze's prompt once {p['shared']:.2f}")
    for rounds, r in bench_dynamic_sampling().items():
        print(f"demo's first 6 GRPO steps, algorithm.dynamic_sampling={rounds[-1]}, medians: "
              f"{r['step_s']:.2f} s a step, {r['datums']:.0f} datums, {r['groups']:.0f} groups "
              "rolled out")
    o = bench_optimizer()
    print(f"AdamW step over all {o['parameters'] / 1e6:.1f} M tiny weights (2 threads), median: "
          f"per-tensor loop {1e3 * o['loop']:.1f} ms, fused {1e3 * o['fused']:.1f} ms")


def unparseable_reply(lm: Any) -> list[int]:
    """8 reply tokens no maze grammar parses, as a random model's: ids 151000-151007 where the
    model's embedding table holds them (the 8B shape's), else the tokens of " wait" x 8."""
    if lm.model.get_input_embeddings().num_embeddings > 151008:
        return list(range(151000, 151008))
    return lm.processor.tokenizer.encode(" wait" * 8)[:8]


class InstantEngine:
    """An engine that answers every request at once with `reply` (`unparseable_reply`),
    streaming each row's next turn as `VLLMEngine.stream` does and building the prompt vLLM
    would be sent for it."""

    name, samples_own_weights = "instant", True

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply

    def play_rows(self, prompts_P: list, n: int, params: SamplingParams, generator: Any,
                  step_row: Any) -> None:
        from workbench.policy import Completion
        from workbench.vllm.engine import vllm_prompt

        pil_cache: dict[int, Any] = {}
        queue = [(row, stream) for row, stream in enumerate(s for s in prompts_P for _ in range(n))]
        while queue:
            row, stream = queue.pop(0)
            vllm_prompt(stream, pil_cache)
            grown = step_row(row, Completion(self.reply, [-1.0] * len(self.reply), "length"))
            if grown is not None:
                queue.append((row, grown))


def bench_rollout_glue(repeats: int = 3) -> dict[str, float]:
    """Median seconds of `play_model` at the 8B shape's rollout (its processor: the 8B shape's
    tokenizer and image settings, on `qwen3-vl-small-shape`'s weights) over `InstantEngine`."""
    from workbench.config import PRESETS
    from workbench.model.presets import build_random
    from workbench.rl.rollout import play_model

    lm = build_random("qwen3-vl-small-shape", torch.float32, "cpu")
    task, params = PRESETS["seed_gpu"].task, SamplingParams(max_tokens=8, temperature=1.0)
    engine = InstantEngine(unparseable_reply(lm))
    states = eval_set(task.size, 8)

    def run() -> None:
        play_model(lm, task, states, 8, params, torch.Generator().manual_seed(0), engine)

    run()
    return {"rollout_s": _median_time(run, repeats), "episodes": 64.0, "turns": 15.0}


def print_glue() -> None:
    """Run bench_rollout_glue and print its figure."""
    torch.set_num_threads(2)
    g = bench_rollout_glue()
    print(f"rollout glue (8B shape's rollout, 64 episodes x 15 turns, generation free), median "
          f"of 3: {g['rollout_s']:.2f} s")


PARTS = {"core": print_core, "serving": print_serving, "ray": print_ray, "glue": print_glue}


def main(argv: list[str]) -> None:
    for name in argv or list(PARTS):
        if name not in PARTS:
            raise SystemExit(f"unknown part {name!r}; choose from {', '.join(PARTS)}")
        PARTS[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
