"""Benchmarks (`make bench`): print medians; nothing here is asserted by tests.

- env: maze steps/s with rendering (image + ascii observation), one thread.
- sampling: tiny default, batch of 64 episodes of 9x9 mazes: prefill tokens/s of the first
  prompt and decode tokens/s (KV cache), plus a full 15-turn model rollout (turns/s).
- serving: the OpenAI endpoint on Ray Serve, requests/s and median latency, with and without
  adapter switching (alone: `python -c "import sys; sys.path.insert(0, 'benchmarks');
  import bench; bench.print_serving()"`).
- ray: a GRPO step of the demo shape in-process vs on a local Ray instance (the same steps,
  alternated), and rollout throughput with 1 vs 2 sampler engines (alone: `... bench.print_ray()`).
- issue 13's cheaper steps: the update with each distinct image encoded once against every
  occurrence encoded, and one AdamW step fused against the per-tensor loop (everything but
  serving and Ray: `... bench.print_core()`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from workbench.envs import MazeConfig, MazeEnv, eval_set
from workbench.model import load_model
from workbench.policy import (
    SamplingParams,
    append_user,
    chat_format,
    decode,
    encode_image,
    extend,
    open_batch,
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


def bench_sampling(batch: int = 64, new_tokens: int = 8, repeats: int = 5) -> dict[str, float]:
    """Median prefill and decode tokens/s for `batch` first-turn prompts."""
    lm = load_model("tiny")
    fmt, pad = chat_format(lm.processor), lm.processor.tokenizer.pad_token_id
    config = MazeConfig(size=9)
    streams = []
    for state in eval_set(9, batch):
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
    config, states = MazeConfig(size=9), eval_set(9, mazes)
    params = SamplingParams(max_tokens=2, temperature=1.0)
    turns = []

    def run() -> None:
        eps = play_model(lm, config, states, group, params, torch.Generator().manual_seed(0))
        turns.append(sum(e.turns for g in eps for e in g))

    seconds = _median_time(run, repeats)
    return {"rollout_s": seconds, "turns_per_s": statistics.median(turns) / seconds}


def bench_grpo_step(repeats: int = 3) -> dict[str, float]:
    """Median per-phase seconds of one GRPO step in the demo shape (8 mazes x 8 samples, 9x9,
    15 turns, LoRA 32). The untrained tiny model earns no reward, so advantages are set to +-1
    by episode parity: the update does the same work as with real signal."""
    import resource

    from workbench.config import PRESETS
    from workbench.rl import phases
    from workbench.rl.schedule import step_mazes
    from workbench.session import (
        AdamParams,
        LossConfig,
        SessionSpec,
        create_session,
        datum_from_stream,
    )

    config = PRESETS["tiny"]
    session = create_session(SessionSpec("tiny", workdir="/tmp/workbench-bench"))
    tc = session.training_client
    out = {k: [] for k in ("rollout", "score", "advantages", "update", "eval", "sampled_tokens_s",
                           "update_tokens_s")}
    for r in range(repeats):
        sampler = tc.save_weights_and_get_sampling_client()
        ro = phases.rollout(sampler, config.maze, step_mazes(config, r + 1), 8,
                            SamplingParams(max_tokens=2, temperature=1.0), seed=r)
        t0 = time.perf_counter()
        sc = phases.score(ro)
        t1 = time.perf_counter()
        phases.advantages(sc.rewards_P_G, "grpo")
        t2 = time.perf_counter()
        datums = [datum_from_stream(ep.stream, 1.0 if k % 2 else -1.0)
                  for k, ep in enumerate(ro.flat)]
        up = phases.update(tc, datums, "ppo", LossConfig(reduction="token_mean"),
                           AdamParams(learning_rate=1e-4))
        ev = phases.evaluate(sampler, config.maze, eval_set(9, 64), greedy=True,
                             sampled_passes=0, max_tokens=2)
        sampled = sum(sum(ep.stream.loss_mask_T) for ep in ro.flat)
        tokens = sum(len(d.stream) for d in datums)
        for key, value in (("rollout", ro.seconds), ("score", t1 - t0), ("advantages", t2 - t1),
                           ("update", up.seconds), ("eval", ev.seconds),
                           ("sampled_tokens_s", sampled / ro.seconds),
                           ("update_tokens_s", tokens / up.seconds)):
            out[key].append(value)
    result = {k: statistics.median(v) for k, v in out.items()}
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    session.close()
    return result


def _update_batch():
    """A tiny session (LoRA 32 with the vision tower) and the 64 datums of one rollout of the
    demo's shape (8 mazes x 8 samples), advantages +-1 in turn."""
    from workbench.config import PRESETS
    from workbench.rl import phases
    from workbench.rl.schedule import step_mazes
    from workbench.session import SessionSpec, create_session, datum_from_stream

    config = PRESETS["tiny"]
    session = create_session(SessionSpec("tiny", config.lora.settings,
                                         workdir="/tmp/workbench-bench"))
    sampler = session.training_client.save_weights_and_get_sampling_client()
    ro = phases.rollout(sampler, config.maze, step_mazes(config, 1), 8,
                        SamplingParams(max_tokens=2, temperature=1.0), seed=0)
    datums = [datum_from_stream(ep.stream, 1.0 if k % 2 else -1.0) for k, ep in enumerate(ro.flat)]
    return session, datums


def _update(tc, datums):
    """One PPO update of these datums (sequence-mean loss, a negligible learning rate)."""
    from workbench.rl import phases
    from workbench.session import AdamParams, LossConfig

    return phases.update(tc, datums, "ppo", LossConfig(reduction="sequence_mean"),
                         AdamParams(learning_rate=1e-6))


def bench_distinct_images(repeats: int = 3) -> dict[str, float]:
    """Median seconds of the same update (8 mazes x 8 samples of one rollout, all 64 episodes,
    LoRA 32 with the vision tower) with each distinct image encoded once, and with every
    occurrence encoded (the code before: `takes_encoder_outputs` patched to False here)."""
    import workbench.policy.forward as forward

    session, datums = _update_batch()
    tc = session.training_client
    images = [img for d in datums for img in d.stream.images]
    out = {"images": len(images), "distinct_images": len(forward.distinct(images)[0])}
    original = forward.takes_encoder_outputs
    for label, takes in (("every_occurrence", lambda cls: False), ("distinct", original)):
        forward.takes_encoder_outputs = takes
        try:
            out[label] = _median_time(lambda: _update(tc, datums), repeats)
        finally:
            forward.takes_encoder_outputs = original
    session.close()
    return out


def bench_shared_prefix(repeats: int = 5) -> dict[str, float]:
    """Median seconds of the update of one rollout's 64 episodes (8 mazes x 8 samples, LoRA 32
    with the vision tower) with each maze's first prompt run once (trainer.share_prefix) and
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
    with trainer.dynamic_sampling=2: median seconds a step, datums a step, groups rolled out."""
    import tempfile

    from workbench.demo import demo_config
    from workbench.rl.train import start, train_step

    out = {}
    for rounds in (0, 2):
        with tempfile.TemporaryDirectory() as folder:
            config = demo_config(Path(folder), overrides=(
                f"trainer.total_steps={steps}", f"trainer.dynamic_sampling={rounds}",
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


def _demo_step(tc, config, step: int) -> float:
    """Seconds of one GRPO step of the demo shape through a session's clients: scale.grpo_step
    (sync, rollout, update with +-1 advantages by episode parity: the untrained tiny model earns
    no reward)."""
    from scale import grpo_step  # benchmarks/ is on sys.path wherever this module is imported

    return grpo_step(tc, config, step).step_s


def bench_ray(steps: int = 3, threads: int = 2) -> dict[str, float]:
    """Median seconds per GRPO step of the demo shape (8 mazes x 8 samples, 9x9, 15 turns, LoRA
    32), in-process and on a local Ray instance (1 trainer + 1 engine colocated, `threads` torch
    threads each, as in-process), the same steps alternated after one warm-up step each; then
    the rollout of one step (64 episodes) on 1 engine x `threads` threads vs 2 engines x 1."""
    import os
    import tempfile

    from workbench.cluster import connect, create_ray_session, disconnect
    from workbench.config import PRESETS
    from workbench.rl import phases
    from workbench.rl.schedule import step_mazes
    from workbench.session import ClusterSpec, SessionSpec, create_session

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a loopback-only instance; no token file
    config, tmp = PRESETS["tiny"], Path(tempfile.mkdtemp(prefix="workbench-bench-ray-"))
    torch.set_num_threads(threads)
    connect("local", num_cpus=2, temp_dir=tmp / "ray", log=lambda *_: None)
    try:
        local = create_session(SessionSpec("tiny", workdir=str(tmp / "inprocess")))
        ray_s = create_ray_session(SessionSpec("tiny", workdir=str(tmp / "ray-session"),
                                               cluster=ClusterSpec("local", colocate_all=True,
                                                                   threads_per_actor=threads)))
        times = {"in-process": [], "ray": []}
        for step in range(steps + 1):
            for name, session in (("in-process", local), ("ray", ray_s)):
                seconds = _demo_step(session.training_client, config, step + 1)
                if step:  # step 0 warms up
                    times[name].append(seconds)
        local.close()
        ray_s.close()
        out = {f"step_s/{k}": statistics.median(v) for k, v in times.items()}
        states, params = step_mazes(config, 1), SamplingParams(max_tokens=2, temperature=1.0)
        for engines, per_engine in ((1, threads), (2, 1)):
            cluster = ClusterSpec("local", num_engines=engines, colocate_all=False,
                                  threads_per_actor=per_engine)
            s = create_ray_session(SessionSpec("tiny", workdir=str(tmp / f"e{engines}"),
                                               cluster=cluster))
            sampler = s.training_client.save_weights_and_get_sampling_client()
            phases.rollout(sampler, config.maze, states, 8, params, seed=0)  # warm-up
            ros = [phases.rollout(sampler, config.maze, states, 8, params, seed=r + 1)
                   for r in range(3)]
            s.close()
            seconds = statistics.median(ro.seconds for ro in ros)
            turns = statistics.median(sum(ep.turns for ep in ro.flat) for ro in ros)
            out[f"rollout_episodes_per_s/{engines}"] = 64 / seconds
            out[f"rollout_turns_per_s/{engines}"] = turns / seconds
    finally:
        disconnect()
    return out


def print_ray(steps: int = 3) -> None:
    """Run bench_ray and print its figures."""
    r = bench_ray(steps)
    local, ray_s = r["step_s/in-process"], r["step_s/ray"]
    print("GRPO step, demo shape (8 mazes x 8 samples, 9x9, 15 turns, LoRA 32, 2 threads), "
          f"median of {steps} alternated: in-process {local:.2f} s, local Ray {ray_s:.2f} s "
          f"(overhead {100 * (ray_s / local - 1):+.1f}%)")
    for engines, label in ((1, "1 engine x 2 threads"), (2, "2 engines x 1 thread")):
        print(f"  rollout of 64 episodes, {label}: {r[f'rollout_episodes_per_s/{engines}']:.1f} "
              f"episodes/s, {r[f'rollout_turns_per_s/{engines}']:.0f} turns/s")


def print_core() -> None:
    """The env, sampler, rollout and GRPO-step figures, the distinct-image update and AdamW
    (everything of `make bench` but serving and Ray)."""
    torch.set_num_threads(1)
    print(f"env: {bench_env():,.0f} steps/s (9x9, 16 px, render every step, 1 thread)")
    torch.set_num_threads(2)
    s = bench_sampling()
    print(f"sampling (tiny, batch 64, 2 threads): prefill {s['prefill_tokens_per_s']:,.0f} "
          f"tokens/s ({s['prompt_tokens']:.0f}-token prompts), "
          f"decode {s['decode_tokens_per_s']:,.0f} tokens/s")
    r = bench_rollout()
    print(f"rollout (tiny, 8 mazes x 8 samples, 15 turns, 2-token replies, 2 threads): "
          f"{r['rollout_s']:.2f} s, {r['turns_per_s']:.0f} turns/s")
    g = bench_grpo_step()
    print("GRPO step (demo shape: 8 mazes x 8 samples, 9x9, 15 turns, LoRA 32, 2 threads), "
          f"median s: rollout {g['rollout']:.2f}, score {g['score']:.4f}, advantages "
          f"{g['advantages']:.4f}, update {g['update']:.2f}, eval (64 mazes greedy) "
          f"{g['eval']:.2f}")
    print(f"  sampled {g['sampled_tokens_s']:,.0f} reply tokens/s, update "
          f"{g['update_tokens_s']:,.0f} tokens/s, peak RSS {g['peak_rss_gb']:.2f} GB")
    d = bench_distinct_images()
    print(f"update of 64 episodes ({d['images']} images, {d['distinct_images']} distinct), "
          "median s: "
          f"every image encoded {d['every_occurrence']:.2f}, each distinct image once "
          f"{d['distinct']:.2f}")
    p = bench_shared_prefix()
    print(f"update of 64 episodes ({p['tokens']} tokens, a {p['prefix']}-token first prompt per "
          f"maze), better of two medians, s: every episode's prompt {p['every_episode']:.2f}, "
          f"each maze's prompt once {p['shared']:.2f}")
    for rounds, r in bench_dynamic_sampling().items():
        print(f"demo's first 6 GRPO steps, trainer.dynamic_sampling={rounds[-1]}, medians: "
              f"{r['step_s']:.2f} s a step, {r['datums']:.0f} datums, {r['groups']:.0f} groups "
              "rolled out")
    o = bench_optimizer()
    print(f"AdamW step over all {o['parameters'] / 1e6:.1f} M tiny weights (2 threads), median: "
          f"per-tensor loop {1e3 * o['loop']:.1f} ms, fused {1e3 * o['fused']:.1f} ms")


def main() -> None:
    print_core()
    print_serving()
    print_ray()


if __name__ == "__main__":
    main()
