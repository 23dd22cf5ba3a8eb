"""The product's GRPO step, timed: `python -m workbench train`'s own step (`rl.train.train_step`)
on a random-weights model, with the phases it logs (time/rollout, time/update, time/weight_sync,
time/rollout_wait) and, when asked, one evaluation (time/eval) and the sampler's decode rate.

    python -m benchmarks.gpu --out runs/bench/gpu.json              # CUDA: vLLM, in-process
    python -m benchmarks.gpu --engine transformers --backend ray    # our engine, on Ray actors
    python -m benchmarks.gpu --off-policy --steps 3                 # algorithm.off_policy_steps=1
    python -m benchmarks.gpu --then-off-policy --anchor --numerics   # the issue's whole set
    python -m benchmarks.gpu --model tiny --device cpu --steps 2    # the same code on a CPU
    python -m benchmarks.gpu --backend inprocess,ray --lora merged,adapter   # side by side

On CUDA a run is the seed_gpu preset on `qwen3-vl-8b-shape` (Qwen3-VL-8B's architecture, random
bf16 weights, `workbench.model.presets`); on the CPU the tiny preset. Both at --mazes x --group
episodes of --turns turns with --max-tokens replies at temperature 1; `key=value` arguments
override any config key. A random model earns the same reward in every episode, so the update
gets `algorithm.advantage=parity` (+-1 by episode index: the work of a real update); it never ends
a reply or an episode early, so every episode plays all its turns with full-length replies.
--engine vllm loads the shape from a folder, saved once under --workdir.

The --warmup steps (compilation, CUDA-graph captures) are left out of the medians; with
--off-policy every timed step takes a rollout sampled beside the update before it, and one more
step after them drains the pipeline. Prints each step's line and a JSON summary (medians; tokens/s
from the logged token counts), also written to --out after each part. After the on-policy steps,
in the same process (the same vLLM, the same compiled layers): --anchor times the live run's
rollout by turns, streamed with every request rendered whole, and streamed (`engine.stream_rows`:
each turn's new tokens rendered), beside vLLM's own loop over the same prompts
(`anchor_rollout`: no environment, no workbench code), in turn ("pace"); --numerics scores
one rollout with the update's forward and with the forward without grad (the KL to the sampler
and the clip fraction of FP8 against bf16 under `speed.fp8_base`); --then-off-policy switches the
live run to algorithm.off_policy_steps=1 and times --steps steps more (one fill step before them,
one drain step after: "off_policy").

Side by side: a comma list in --backend or --lora (`engine.vllm_lora`) runs each backend for
each LoRA way as a process of its own, one after another on the same GPU, and prints one table
of their phases with each backend's step over the first backend's ("ratio").

Answers: What does the product's GRPO step cost on one GPU, phase by phase, in-process and on
Ray? Figures: benchmarks/RESULTS.md, "A step on the H200".
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

H200_BF16_TFLOPS = 989.0  # dense bf16 tensor-core peak of an H200 SXM (no sparsity)
BACKENDS = ("inprocess", "ray")
LORA_WAYS = ("merged", "adapter")
PHASES = ("time/step", "time/rollout", "time/update", "time/weight_sync", "time/rollout_wait")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="vllm" if cuda else "transformers",
                    choices=("transformers", "vllm"), help="engine.name")
    ap.add_argument("--backend", default="inprocess", help="inprocess or ray (cluster."
                    "address=local: a trainer and an engine actor), or both: inprocess,ray")
    ap.add_argument("--lora", default="", help="engine.vllm_lora: merged, adapter or both "
                    "(merged,adapter); default the preset's")
    ap.add_argument("--model", default="qwen3-vl-8b-shape" if cuda else "tiny",
                    help="a shape of workbench.model.presets, tiny, or a checkpoint folder")
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="steps before them, not timed")
    ap.add_argument("--off-policy", action="store_true", help="algorithm.off_policy_steps=1")
    ap.add_argument("--then-off-policy", action="store_true", help="--steps on-policy, then "
                    "--steps with algorithm.off_policy_steps=1 in the same process")
    ap.add_argument("--anchor", action="store_true", help="then time vLLM's own loop over the "
                    "rollout's prompts beside the live run's rollout streamed and by turns "
                    "(engine vllm, in-process)")
    ap.add_argument("--numerics", action="store_true", help="then score one rollout's datums "
                    "with the update's forward (grad on: FP8 with speed.fp8_base) and without "
                    "grad (bf16): KL to the sampler and PPO clip fraction of each")
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS", help="then profile "
                    "CALLS forward_backward calls of the update (torch.profiler): wall time, "
                    "GPU kernel time and the kernels that take most of it")
    ap.add_argument("--mazes", type=int, default=8, help="P (trainer.train_batch_size)")
    ap.add_argument("--group", type=int, default=8, help="G (generator.n_samples_per_prompt)")
    ap.add_argument("--turns", type=int, default=15, help="generator.max_turns")
    ap.add_argument("--max-tokens", type=int, default=8, help="generator.max_tokens")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    ap.add_argument("--eval", action="store_true", help="then time one evaluation")
    ap.add_argument("--decode", type=int, default=0, metavar="TOKENS", help="then time a batch "
                    "decode of TOKENS tokens a row, P x G first-turn rows (in-process only)")
    ap.add_argument("--workdir", default="", help="run folder and saved model (default: a temp)")
    ap.add_argument("--out", default="", help="JSON file for the summary")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    for flag, valid in (("backend", BACKENDS), ("lora", LORA_WAYS)):
        bad = [v for v in listed(getattr(args, flag)) if v not in valid]
        if bad:
            ap.error(f"--{flag} {','.join(bad)}: choose from {', '.join(valid)}")
    if args.off_policy and args.warmup < 1:
        ap.error("--off-policy needs --warmup >= 1: the first step samples on-policy")
    if args.off_policy and args.then_off_policy:
        ap.error("--then-off-policy already times off-policy steps after the on-policy ones")
    return args


def listed(value: str) -> list[str]:
    """`a,b` -> [a, b]; empty -> []."""
    return [v for v in value.split(",") if v]


def bench_config(args: argparse.Namespace, workdir: Path) -> Any:
    """The preset of the device with this benchmark's settings (see the module docstring)."""
    from workbench.config import PRESETS, apply_overrides
    from workbench.model.presets import SHAPES, save_random

    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    model = args.model
    if args.engine == "vllm" and model in SHAPES:  # vLLM loads from disk
        model = save_random(model, workdir / "model", getattr(torch, dtype), args.device)
    steps = args.warmup + args.steps + (1 if args.off_policy else 0) \
        + (args.steps + 2 if args.then_off_policy else 0)
    overrides = [
        f"model.name={model}", f"model.device={args.device}", f"model.dtype={dtype}",
        f"engine.name={args.engine}", f"trainer.train_batch_size={args.mazes}",
        f"generator.n_samples_per_prompt={args.group}", f"generator.max_turns={args.turns}",
        f"generator.max_tokens={args.max_tokens}", "generator.temperature=1.0",
        "algorithm.advantage=parity", f"trainer.total_steps={steps}",
        f"algorithm.off_policy_steps={int(args.off_policy)}", "trainer.ckpt_interval=0",
        "trainer.hf_save_interval=0", "trainer.eval_interval=0",
        "trainer.keep_step_records=false", "trainer.resume_mode=none", "trainer.overwrite=true",
        f"run_dir={workdir / 'run'}"]
    if args.backend == "ray":
        overrides.append("cluster.address=local")
    if args.lora:
        overrides.append(f"engine.vllm_lora={args.lora}")
    return apply_overrides(PRESETS["seed_gpu" if cuda else "tiny"], overrides + args.overrides)


def first_prompts(processor: Any, config: Any, n: int) -> list[Any]:
    """The first-turn prompts (system rules, image, text) of the first n eval mazes, as a
    rollout builds them (`rl.rollout.observe`)."""
    from workbench.envs import MazeEnv, eval_set
    from workbench.policy import chat_format, start_stream
    from workbench.rl.rollout import observe

    fmt, out = chat_format(processor), []
    for state in eval_set(config.size, n):
        obs, info = MazeEnv(config).reset(options={"init_state": state})
        out.append(observe(start_stream(processor, fmt, config.rules()), processor, fmt, obs,
                           info, config))
    return out


def time_decode(engine: Any, prompts_P: list[Any], n: int, tokens: int,
                repeats: int = 3) -> dict[str, float]:
    """Prefill and decode of P x n rows through an engine's rows (`engine.open(...).decode`),
    the same for every engine: a 1-token reply times the prefill; a (1 + tokens)-token one
    minus it, per token drawn, times the decode. Medians of `repeats` after one warm-up."""
    from workbench.policy import SamplingParams

    def run(length: int, seed: int) -> tuple[float, int]:
        params = SamplingParams(max_tokens=length, temperature=1.0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            drawn = engine.open(prompts_P, n).decode(params, torch.Generator().manual_seed(seed))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start, sum(len(c.tokens) for c in drawn)

    run(1, 0), run(1 + tokens, 0)  # warm-up: graph captures, compilation
    ones = [run(1, r) for r in range(repeats)]
    longs = [run(1 + tokens, r) for r in range(repeats)]
    prefill_s = statistics.median(s for s, _ in ones)
    decode_s = statistics.median(s for s, _ in longs) - prefill_s
    drawn = statistics.median(k for _, k in longs) - statistics.median(k for _, k in ones)
    return {"rows": len(prompts_P) * n, "prefill_s": prefill_s,
            "prefill_tokens_per_s": sum(len(p) for p in prompts_P) / prefill_s,
            "decode_tokens_per_s": drawn / decode_s,
            "decode_ms_per_step": 1000 * decode_s * len(prompts_P) * n / drawn}


def run_steps(trainer: Any, n: int, log: Any) -> list[dict[str, Any]]:
    """n more steps of the live run (`rl.train.train_step`), a line each: their rows."""
    from workbench.rl.train import step_line, train_step

    rows = []
    for _ in range(n):
        rows.append(train_step(trainer))
        log(step_line(rows[-1]) + "  " + "  ".join(
            f"{k.removeprefix('time/')} {rows[-1][k]:.2f}" for k in PHASES[1:]))
    return rows


def off_policy(config: Any) -> Any:
    """The run's config with algorithm.off_policy_steps=1 (each step's rollout sampled beside
    the update before it)."""
    from dataclasses import replace

    return replace(config, algorithm=replace(config.algorithm, off_policy_steps=1))


def cut(stream: Any, a: int, b: int) -> Any:
    """Tokens a..b-1 of a stream, with the images whose runs start there."""
    from workbench.policy import Stream

    def runs_before(t: int) -> int:
        types_T = stream.mm_types_T
        return sum(1 for u in range(t) if types_T[u] and (u == 0 or not types_T[u - 1]))

    return Stream(stream.tokens_T[a:b], stream.mm_types_T[a:b], stream.loss_mask_T[a:b],
                  stream.logprobs_T[a:b], stream.images[runs_before(a):runs_before(b)])


def reply_runs(stream: Any) -> list[tuple[int, int]]:
    """(first, last + 1) of each reply of a played stream (`Stream.reply_index_T`'s runs)."""
    runs: dict[int, tuple[int, int]] = {}
    for t, reply in enumerate(stream.reply_index_T()):
        if reply >= 0:
            runs[reply] = (runs.get(reply, (t, t))[0], t + 1)
    return list(runs.values())


def turn_segments(stream: Any) -> list[Any]:
    """A played stream cut at its replies: the prompt before the first reply, then what
    followed each reply up to the next one (the user turn the environment appended)."""
    runs = reply_runs(stream)
    bounds = [(0, runs[0][0])] + [(end, nxt) for (_, end), (nxt, _) in zip(runs, runs[1:])]
    return [cut(stream, a, b) for a, b in bounds]


def anchor_rollout(engine: Any, episodes: list[Any], max_tokens: int) -> float:
    """vLLM's own multi-turn loop over a played rollout's own prompts, with no environment and no
    workbench code in it: each turn one `LLM.generate` over every row, each row's prompt its
    episode's stream up to that turn (the same tokens, images and content ids as the rollout's
    requests, `vllm_prompt`) with vLLM's own sampled reply in place of the episode's, rendered
    whole by vLLM. Seeded per row and turn, full-length replies (ignore_eos, as a random model's
    are). The prompts are cut before the clock starts. Returns the loop's seconds."""
    from vllm import SamplingParams as VParams

    from workbench.vllm.engine import vllm_prompt

    pil_cache: dict[int, Any] = {}
    parts = [[vllm_prompt(s, pil_cache) for s in turn_segments(ep.stream)] for ep in episodes]
    ids = [list(p[0]["prompt_token_ids"]) for p in parts]
    images = [list(p[0]["multi_modal_data"]["image"]) for p in parts]
    uuids = [list(p[0]["multi_modal_uuids"]["image"]) for p in parts]
    start = time.perf_counter()
    for k in range(min(len(p) for p in parts)):
        prompts = [{"prompt_token_ids": ids[i], "multi_modal_data": {"image": images[i]},
                    "multi_modal_uuids": {"image": uuids[i]}} for i in range(len(parts))]
        params = [VParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                          detokenize=False, seed=1000 * i + k) for i in range(len(parts))]
        outs = engine.llm.generate(prompts, params, use_tqdm=False)
        for i, out in enumerate(outs):
            if k + 1 < len(parts[i]):
                nxt = parts[i][k + 1]
                ids[i] = ids[i] + list(out.outputs[0].token_ids) + nxt["prompt_token_ids"]
                images[i] = images[i] + nxt.get("multi_modal_data", {}).get("image", [])
                uuids[i] = uuids[i] + nxt.get("multi_modal_uuids", {}).get("image", [])
    return time.perf_counter() - start


def render_check(engine: Any, episodes: list[Any], rows: int = 4) -> dict[str, int]:
    """vLLM's whole rendering of the first `rows` episodes' prompts at every turn against the
    engine inputs a streamed row makes from its last one (`vllm.render.RowRequests`): the
    requests compared and, per field, how many differ. Then vLLM's processor caches are cleared
    (these renders were never sent to its engine core)."""
    from workbench.vllm.engine import vllm_prompt
    from workbench.vllm.render import RowRequests, render

    pil_cache: dict[int, Any] = {}
    made = RowRequests(engine.llm, lambda s: vllm_prompt(s, pil_cache))
    out = {"requests": 0, "prompt_token_ids": 0, "mm_hashes": 0, "mm_placeholders": 0}
    for row, ep in enumerate(episodes[:rows]):
        for first, _ in reply_runs(ep.stream):
            prefix = cut(ep.stream, 0, first)
            ours = made.engine_input(row, prefix)
            whole = render(engine.llm, vllm_prompt(prefix, pil_cache))
            out["requests"] += 1
            for key in ("prompt_token_ids", "mm_hashes"):
                out[key] += ours[key] != whole[key]
            out["mm_placeholders"] += placeholders(ours) != placeholders(whole)
    engine.llm.reset_mm_cache()
    return out


def placeholders(engine_input: dict[str, Any]) -> list[tuple[int, int, bool]]:
    """An engine input's image placeholders: (offset, length, whether all of it is embedded)."""
    return [(p.offset, p.length, p.is_embed is None)
            for p in engine_input["mm_placeholders"]["image"]]


def rollout_pace(trainer: Any, host: Any, config: Any, args: argparse.Namespace,
                 repeats: int = 2) -> dict[str, Any]:
    """The live run's rollout (`phases.rollout` of the next step's batch, the run's sampler)
    by turns (engine.stream_rows=false), streamed with each request rendered whole (as
    `LLM.enqueue` renders it), streamed (each turn's new tokens rendered: the default), and
    vLLM's own loop over the last streamed rollout's prompts (`anchor_rollout`), in turn,
    `repeats` times; medians, the ratios to vLLM's own loop, the prompt tokens vLLM counted
    in the last run of each, and `render_check`."""
    from workbench.rl import phases
    from workbench.rl.schedule import step_batch

    engine = host.engine
    sampler = trainer.training_client.save_weights_and_get_sampling_client()
    batch = step_batch(config, trainer.step + 1)
    modes = ("by_turns", "streamed_whole", "streamed", "anchor")
    runs: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens: dict[str, dict[str, int]] = {}
    episodes: list[Any] = []
    for _ in range(repeats):
        for mode in modes:  # by turns first: it merges the version once
            before = prompt_counts(engine.llm)
            if mode == "anchor":
                runs[mode].append(anchor_rollout(engine, episodes, args.max_tokens))
            else:
                engine.stream_rows = mode != "by_turns"
                engine.render_by_turn = mode == "streamed"
                record = phases.rollout(sampler, batch)
                runs[mode].append(record.seconds)
                episodes = [ep for group in record.episodes_P_G for ep in group]
            tokens[mode] = {k: v - before[k] for k, v in prompt_counts(engine.llm).items()}
    engine.stream_rows, engine.render_by_turn = config.engine.stream_rows, True
    out: dict[str, Any] = {f"{k}_runs_s": v for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in runs.items()}
    return out | {f"{k}_s": v for k, v in med.items()} | {
        f"{k}_over_anchor": med[k] / med["anchor"] for k in modes[:-1]} | {
        "prompt_tokens": tokens, "render_check": render_check(engine, episodes)}


def prompt_counts(llm: Any) -> dict[str, int]:
    """vLLM's counters of prompt tokens, and of those found in its prefix cache."""
    from workbench.vllm.engine import counter_total

    metrics = llm.get_metrics()
    return {"prompt": counter_total(metrics, "vllm:prompt_tokens"),
            "cached": counter_total(metrics, "vllm:prefix_cache_hits")}


def fresh_datums(trainer: Any, config: Any) -> list[Any]:
    """The datums of one fresh rollout of the live run's next step (its batch, its sampler's
    weights, its advantages), for the parts that score or profile the update."""
    from workbench.rl import phases
    from workbench.rl.schedule import step_batch

    client, step = trainer.training_client, trainer.step + 1
    ro = phases.rollout(client.save_weights_and_get_sampling_client(), step_batch(config, step))
    adv = phases.advantages(phases.score(ro).rewards_P_G, config.algorithm.advantage,
                            ro.episodes_P_G)
    return phases.make_datums(ro, adv)


def numerics(trainer: Any, config: Any, minibatch: int) -> dict[str, Any]:
    """One fresh rollout's datums scored twice against the sampler's log-probs: by the update's
    own forward (grad on: the compiled layers, FP8 with speed.fp8_base) and by the forward
    without grad (bf16, eager). Token-weighted KL (k3) and PPO clip fraction of each, in chunks
    of `minibatch` datums. Its gradients are left accumulated (the caller drops them)."""
    from dataclasses import replace

    from workbench.rl import phases
    from workbench.rl.schedule import step_update

    client, step = trainer.training_client, trainer.step + 1
    datums = fresh_datums(trainer, config)
    loss = replace(step_update(config, step).loss, tis_cap=0.0)  # PPO's ratio to the sampler
    out: dict[str, Any] = {}
    for name, call in (("with_grad", client.forward_backward), ("no_grad_bf16", client.forward)):
        metrics = [call(datums[i:i + minibatch], "ppo", loss).result().metrics
                   for i in range(0, len(datums), minibatch)]
        mean = phases.token_weighted(metrics)
        out[name] = {k: mean[k] for k in ("kl_sampler_trainer", "clip_fraction")} | {
            "tokens": sum(m["tokens"] for m in metrics)}
    return out


def kernel_family(name: str) -> str:
    """A CUDA kernel's family, for the profile's summary: GEMM (cuBLAS names no dtype the same
    way across kernels, so bf16 and FP8 GEMMs are one family; the top kernels tell them apart),
    attention, elementwise (compiled by inductor: triton_*), copy, or the name's head."""
    low = name.lower()
    if "flash" in low or "fmha" in low or "attention" in low:
        return "attention"
    if "gemm" in low or "cutlass" in low or "sm90_xmma" in low or "nvjet" in low:
        return "gemm"
    if low.startswith("triton_"):
        return "triton (compiled elementwise)"
    if "copy" in low or "memcpy" in low or "memset" in low:
        return "copy"
    return name.split("<")[0].split("(")[0][:60]


def profile_update(trainer: Any, config: Any, calls: int) -> dict[str, Any]:
    """`calls` forward_backward calls of a fresh rollout's datums (`algorithm.minibatch` each),
    run in this thread (`session.host.forward`, in-process sessions) under torch.profiler:
    their wall seconds, the GPU's kernel seconds, the share idle, the kernel families and
    kernels that take the most GPU time, the operators that take the most CPU time, and the
    allocator's retries (a full cache freed: a device sync) so far. The gradients are
    dropped."""
    from torch.profiler import ProfilerActivity, profile

    from workbench.rl.schedule import step_update
    from workbench.session.host import forward

    datums, m = fresh_datums(trainer, config), config.algorithm.minibatch
    loss = step_update(config, trainer.step + 1).loss
    cuda, model_host = torch.cuda.is_available(), trainer.session.host
    forward(model_host, datums[:m], "ppo", loss, True)  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:  # in this thread: its CPU operators recorded
        start = time.perf_counter()
        for i in range(calls):
            forward(model_host, datums[i * m:(i + 1) * m], "ppo", loss, True)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time_total / 1e6)
    gpu = sum(sum(v) for v in kernels.values())
    families: dict[str, float] = {}
    for name, times in kernels.items():
        family = kernel_family(name)
        families[family] = families.get(family, 0.0) + sum(times)
    top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:15]
    cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) if cuda else 0
    return {"calls": calls, "datums_per_call": m, "wall_s": wall, "gpu_kernel_s": gpu,
            "gpu_idle_share": 1 - gpu / wall if cuda else None, "alloc_retries": retries,
            "top_cpu_ops": [[e.key[:80], round(e.self_cpu_time_total / 1e6, 4), e.count]
                            for e in cpu],
            "families_s": dict(sorted(families.items(), key=lambda kv: -kv[1])[:12]),
            "top_kernels": [[name[:100], round(sum(t), 4), len(t)] for name, t in top]}


def summarize(rows: list[dict[str, Any]], episodes: int) -> dict[str, float]:
    """Medians over the timed steps: each phase's seconds, tokens/s, the sampler/trainer KL, the
    PPO clip fraction and the sampler's own counters (vllm/*)."""
    def med(values: Any) -> float:
        return statistics.median(values)

    out = {k.removeprefix("time/") + "_s": med(r[k] for r in rows) for k in PHASES}
    trained = [r for r in rows if "update/loss" in r]
    peaks = [r["memory/gpu_peak_gb"] for r in rows if "memory/gpu_peak_gb" in r]
    if peaks:
        out["gpu_peak_gb"] = max(peaks)
    out |= {"sampled_tokens_per_s": med(r["rollout/reply_tokens_mean"] * episodes
                                        / r["time/rollout"] for r in rows),
            "episode_tokens_mean": med(r["rollout/tokens_mean"] for r in rows),
            "turns_mean": med(r["rollout/turns_mean"] for r in rows)}
    if trained:
        out |= {"update_tokens_per_s": med(r["rollout/tokens_mean"] * r["update/datums"]
                                           / r["time/update"] for r in trained),
                "kl_sampler_trainer": med(r["update/kl_sampler_trainer"] for r in trained),
                "clip_fraction": med(r["update/clip_fraction"] for r in trained)}
    for key in sorted({k for r in rows for k in r if k.startswith("vllm/")}):
        out[key] = med(r[key] for r in rows if key in r)
    return out


def update_mfu(summary: dict[str, Any], model: Any) -> dict[str, float]:
    """The update's model FLOP rate, by one stated convention: per trained token 4 N_text (the
    frozen text linear layers' forward and activation gradient, N_text their weights), leaving
    out attention scores, LoRA, the lm_head and the vision tower (a lower bound); as a share of
    the H200's dense bf16 peak, in FP8 too, so the two read on one scale."""
    from workbench.session.fp8 import frozen_linears

    n_text = sum(m.weight.numel() for m in frozen_linears(model))
    tflops = summary["update_tokens_per_s"] * 4 * n_text / 1e12
    return {"update_model_tflops": tflops, "update_mfu_bf16_peak": tflops / H200_BF16_TFLOPS}


def machine(args: argparse.Namespace) -> dict[str, Any]:
    """Where, when and at which commit."""
    import transformers

    git = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                         text=True, cwd=Path(__file__).parent).stdout.strip()
    return {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": git,
            "argv": sys.argv[1:], "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else
            f"cpu ({torch.get_num_threads()} threads)"}


def bench(argv: list[str] | None = None, log: Any = print) -> dict[str, Any]:
    """Run the benchmark of `argv` (the command line's arguments) -> its summary."""
    from workbench.rl.train import run_eval, start

    args = parse(argv)
    if len(listed(args.backend)) > 1 or len(listed(args.lora)) > 1:
        return side_by_side(args, argv if argv is not None else sys.argv[1:], log)
    if args.threads:
        torch.set_num_threads(args.threads)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="workbench-bench-"))
    config = bench_config(args, workdir)
    trainer = start(config, log)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    try:
        rows = run_steps(trainer, args.warmup + args.steps + int(args.off_policy), log)
        timed = rows[args.warmup:args.warmup + args.steps]
        summary: dict[str, Any] = {"machine": machine(args), "config": {
            "model": config.model.name, "engine": args.engine, "backend": args.backend,
            "off_policy": args.off_policy,
            "then_off_policy": args.then_off_policy, "P": args.mazes, "G": args.group,
            "turns": args.turns, "max_tokens": args.max_tokens, "warmup": args.warmup},
            "steps": len(timed), **summarize(timed, args.mazes * args.group)}
        host = getattr(trainer.session, "host", None)  # in-process sessions only
        if host is not None and "update_tokens_per_s" in summary and args.device == "cuda":
            summary |= update_mfu(summary, host.lm.model)
        save(summary, args.out)
        if args.anchor:
            if host is None or args.engine != "vllm":
                raise SystemExit("--anchor times vLLM's own loop: use --engine vllm "
                                 "--backend inprocess")
            summary["pace"] = rollout_pace(trainer, host, config, args)
            summary["rollout_over_anchor"] = summary["rollout_s"] / summary["pace"]["anchor_s"]
            log(f"pace: {json.dumps(summary['pace'])}")
            save(summary, args.out)
        if args.numerics:
            summary["numerics"] = numerics(trainer, config, config.algorithm.minibatch)
            if host is not None:
                host.optimizer.zero_grad(set_to_none=True)  # the timed steps go on without them
            log(f"numerics: {json.dumps(summary['numerics'])}")
            save(summary, args.out)
        if args.profile:
            if host is None:
                raise SystemExit("--profile runs the host's calls: use --backend inprocess")
            summary["profile"] = profile_update(trainer, config, args.profile)
            host.optimizer.zero_grad(set_to_none=True)
            log(f"profile: {json.dumps(summary['profile'])}")
            save(summary, args.out)
        if args.then_off_policy:  # the fill step, the timed lagged steps, the drain step
            trainer.config = off_policy(trainer.config)
            lagged = run_steps(trainer, args.steps + 2, log)[1:-1]
            summary["off_policy"] = {"steps": len(lagged),
                                     **summarize(lagged, args.mazes * args.group)}
            save(summary, args.out)
        if args.eval:
            summary["eval_s"] = run_eval(trainer).seconds
        if args.decode:
            if host is None:
                raise SystemExit("--decode times the in-process engine: use --backend inprocess")
            prompts = first_prompts(trainer.training_client.get_processor(), config.task,
                                    args.mazes)
            summary["decode"] = time_decode(host.engine, prompts, args.group, args.decode)
    finally:
        trainer.session.close()
    summary["base_rss_gb"] = base_rss
    summary["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.device == "cuda":
        summary["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9  # this process's
    save(summary, args.out)
    return summary


SIDE_COLUMNS = ("step_s", "rollout_s", "update_s", "weight_sync_s", "kl_sampler_trainer",
                "gpu_peak_gb")


def side_by_side(args: argparse.Namespace, argv: list[str], log: Any) -> dict[str, Any]:
    """Each --backend for each --lora way as its own `python -m benchmarks.gpu` process, one
    after another, with the other arguments as given -> {"runs": {"backend/lora": summary},
    "table": markdown}; a run that failed keeps its exit status and the first error line
    (`gpu_paths.first_error`, as `make test-gpu` tells a failed path)."""
    from benchmarks import gpu_paths

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="workbench-side-"))
    rest = without(argv, ("--backend", "--lora", "--workdir", "--out"))
    runs: dict[str, Any] = {}
    for lora in listed(args.lora) or [""]:
        for backend in listed(args.backend):
            name = f"{backend}/{lora}" if lora else backend
            stem = workdir / name.replace("/", "-")
            out = stem.with_suffix(".json")
            child = [sys.executable, "-m", "benchmarks.gpu", *rest, "--backend", backend,
                     "--workdir", str(stem), "--out", str(out), *(["--lora", lora] * bool(lora))]
            log(f"side by side: {name}: {' '.join(child[1:])}")
            done = subprocess.run(child, cwd=Path(__file__).resolve().parent.parent,
                                  capture_output=True, text=True)
            stem.with_suffix(".log").write_text(done.stdout + done.stderr)
            runs[name] = json.loads(out.read_text()) if done.returncode == 0 else {
                "returncode": done.returncode,
                "error": gpu_paths.first_error(done.stdout + done.stderr)}
            log(f"side by side: {name}: " + (f"step {runs[name]['step_s']:.2f} s"
                                             if "step_s" in runs[name] else runs[name]["error"]))
    summary = {"machine": machine(args), "runs": runs, "table": side_table(runs)}
    log(summary["table"])
    save(summary, args.out)
    return summary


def without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv less each of `flags` and its value (`--flag v` or `--flag=v`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out


def side_table(runs: dict[str, Any]) -> str:
    """One markdown row a run: its phases and, under each LoRA way, its step over the first
    backend's step."""
    head = ["run", *SIDE_COLUMNS, "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first: dict[str, float] = {}
    for name, run in runs.items():
        way = name.partition("/")[2]
        if "step_s" not in run:
            lines.append(f"| {name} | " + run["error"].replace("|", "/") + " |"
                         + " |" * (len(head) - 2))
            continue
        first.setdefault(way, run["step_s"])
        cells = [f"{run[k]:.3g}" if k in run else "-" for k in SIDE_COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {run['step_s'] / first[way]:.2f}x |")
    return "\n".join(lines)


def save(summary: dict[str, Any], out: str) -> None:
    """The summary so far to `out` (if given): a run stopped part way keeps what it measured."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    print(json.dumps(bench(), indent=1))
