"""vLLM and the workbench's own engine side by side, in one command on one GPU: the same weights
(the seed's Qwen3-VL-8B shape, random bf16, saved to disk once: vLLM loads from a folder), the
same 8 seed mazes x 8 samples, 15 turns with an image every turn, 8-token replies.

For each engine (`--engines`, in order; each in its own session, the first closed before the
next opens):
  decode    batch-64 decode: 64 first-turn rows (8 prompts x 8), (time(1 + D) - time(1)) / D per
            step, median of --repeats; the same rows API (`engine.open(...).decode(...)`) for both
  rollout   the seed-shape rollout through `phases.rollout` (environment stepped, replies parsed):
            a warm-up, then median of --repeats; sampled tokens/s; vLLM's prefix-cache hit rate
  anchor    (vllm) the same 15-turn loop on vLLM's own `LLM.generate` with no environment and no
            workbench code (shared/gpu/vllm_8b.py's loop), then adding one at a time what our
            rollout sends: the LoRA adapter, log-probs + logit bias, the rollout's own images
            (--anchor-variants): where the rollout's time over vLLM's own goes
  step      (--step-engines) a whole GRPO step through the session, per phase (benchmarks/gpu.py's
            `grpo_step`: update with +-1 advantages, a random model earns no reward)

    PYTHONUNBUFFERED=1 python3 benchmarks/side_by_side.py --out $OUT          # one H200
    python benchmarks/side_by_side.py --shape tiny --device cpu --engines transformers --quick

Prints one line per figure and a summary; writes side_by_side.json to --out after each section.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu  # noqa: E402  (benchmarks/gpu.py: timing, model facts, the GRPO step)
from vllm_agreement import save_shape  # noqa: E402

from workbench.envs import eval_set  # noqa: E402
from workbench.model import LoraSettings  # noqa: E402
from workbench.policy import SamplingParams  # noqa: E402
from workbench.policy.engine import EngineSettings  # noqa: E402
from workbench.rl import phases  # noqa: E402
from workbench.session import create_session  # noqa: E402
from workbench.session.spec import SessionSpec, SpeedSettings  # noqa: E402

RESULTS: dict[str, Any] = {}


def save(out: Path) -> None:
    (out / "side_by_side.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def session_spec(args: Any, model: str, engine: str) -> SessionSpec:
    """The seed_gpu preset's settings for `engine` (the transformers engine: CUDA graphs over
    fused, compiled decode; the trainer: bf16 LoRA, lm_head on loss tokens, compiled layers)."""
    cuda = args.device == "cuda"
    speed = SpeedSettings(cuda_graphs=cuda and engine == "transformers",
                          kv_rows=args.mazes * args.group, kv_tokens=3072,
                          compile_decode=cuda and not args.quick, loss_tokens_only=True,
                          lora_autocast=cuda, compile_layers=cuda and args.compile_layers)
    dtype = "bfloat16" if cuda or engine == "vllm" else "float32"  # vLLM's LoRA: bf16 / fp16
    return SessionSpec(model, LoraSettings(rank=32, alpha=64), f"{args.workdir}/{engine}",
                       dtype, args.device,
                       EngineSettings(engine, gpu_memory_utilization=args.memory,
                                      vllm_lora=args.vllm_lora), speed)


def bench_decode(host: Any, args: Any, device: torch.device) -> dict[str, float]:
    """Batch P x G decode through the engine's rows: per step = (t(1 + D) - t(1)) / D, with
    <|im_end|> never stopping it (a random model rarely draws it; the rows use the same ban)."""
    config = gpu.seed_config(args)
    prompts = gpu.first_prompts(host, config, args.mazes)
    engine = host.engine

    def run(tokens: int, seed: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=1.0)
        gen = torch.Generator().manual_seed(seed)
        return gpu.timed(lambda: engine.open(prompts, args.group).decode(params, gen),
                         device)[1]

    D = args.decode_tokens
    run(1, 0), run(1 + D, 0)  # warm-up (graph captures, compilation)
    ones = [run(1, r) for r in range(args.repeats)]
    longs = [run(1 + D, r) for r in range(args.repeats)]
    step_s = (statistics.median(longs) - statistics.median(ones)) / D
    rows = args.mazes * args.group
    return {"rows": rows, "decode_tokens": D, "decode_ms_per_step": 1000 * step_s,
            "decode_tokens_per_s": rows / step_s, "first_token_s": statistics.median(ones)}


def bench_rollout(session: Any, args: Any, device: torch.device) -> dict[str, Any]:
    """The seed-shape rollout (environment stepped): warm-up, then the median of --repeats."""
    sampler = session.training_client.save_weights_and_get_sampling_client()
    config = gpu.seed_config(args)
    states = eval_set(config.size, args.mazes)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    session.speed_metrics().result()  # counters from here on
    runs = []
    for r in range(1 + args.repeats):
        ro, s = gpu.timed(lambda r=r: phases.rollout(sampler, phases.Batch(
            config, states, args.group, params, 100 + r)), device)
        sampled = sum(sum(ep.stream.loss_mask_T) for ep in ro.flat)
        turns = sum(ep.turns for ep in ro.flat)
        metrics = session.speed_metrics().result()  # this rollout's (vLLM: cache, generate_s)
        runs.append({"s": s, "sampled_tokens": sampled, "turns": turns,
                     "episode_tokens_mean": statistics.mean(len(ep.stream) for ep in ro.flat),
                     "speed_metrics": metrics})
        inside = (f", {metrics['vllm/generate_s']:.2f} s of it inside vLLM's generate"
                  if "vllm/generate_s" in metrics else "")
        gpu.log(f"  rollout {'warm-up' if r == 0 else r}: {s:.2f} s{inside}, {turns} turns, "
                f"{sampled} sampled tokens")
    timed_runs = runs[1:]
    s = statistics.median(x["s"] for x in timed_runs)
    episodes = ro.flat  # the last rollout's: the anchor replays its first prompts and images
    return {"rollout_s": s, "runs": runs, "turns": timed_runs[0]["turns"],
            "sampled_tokens_per_s": statistics.median(x["sampled_tokens"] / x["s"]
                                                      for x in timed_runs),
            "episode_tokens_mean": timed_runs[0]["episode_tokens_mean"],
            "speed_metrics": runs[-1]["speed_metrics"], "episodes": episodes}


ANCHOR_VARIANTS = ("plain", "lora", "lora+logprobs", "lora+logprobs+images",
                   "lora+logprobs+images+uuids")
"""vLLM's own loop, each variant adding one thing the workbench's rollout does: the adapter of
the weights version (a LoRARequest), the sampled token's log-prob with the logit bias on banned
tokens, and the images the rollout really saw (a new one each turn) instead of one re-sent; the
last gives each image a content id (`multi_modal_uuids`), so vLLM does not hash its pixels."""


def anchor_images(episodes: list[Any], rows: int, turns: int, fresh: bool) -> list[list[Any]]:
    """Row i's image at each turn: the rollout's own (fresh) or its first, re-sent."""
    from PIL import Image

    out = []
    for ep in episodes[:rows]:
        seen = [Image.fromarray(im.image_HW3) for im in ep.stream.images]
        out.append([seen[min(k, len(seen) - 1)] if fresh else seen[0] for k in range(turns)])
    return out


def bench_anchor(engine: Any, host: Any, args: Any, episodes: list[Any],
                 variant: str) -> dict[str, float]:
    """vLLM's own 15-turn loop at the same shape, no environment and no workbench code: each of
    the P x G rows appends its sampled ids, <|im_end|>, and a fixed next user turn with an image
    (shared/gpu/vllm_8b.py's loop), plus what `variant` adds (ANCHOR_VARIANTS)."""
    from vllm import SamplingParams as VParams

    from workbench.policy.vllm_engine import BAN_BIAS, image_uuid, lora_request, vllm_prompt

    tok, fmt = host.lm.processor.tokenizer, host.fmt
    close_ids = [fmt.im_end] + tok.encode("\n", add_special_tokens=False)
    user_ids = tok.encode("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                          "Invalid action. This is step 2.<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)
    if user_ids.count(fmt.image_pad) != 1:
        raise RuntimeError("the anchor's user turn must hold exactly one <|image_pad|>")
    B = args.mazes * args.group
    images = anchor_images(episodes, B, args.turns, "images" in variant)
    first = [vllm_prompt(p) for p in gpu.first_prompts(host, gpu.seed_config(args), args.mazes)]
    ids = [list(first[i // args.group]["prompt_token_ids"]) for i in range(B)]  # the rollout's
    lora = None
    if "lora" in variant and engine.version is not None:
        lora = lora_request(engine.lora_cls, engine.version, engine.adapter_folder(engine.version))
    extra = {"logprobs": 0, "logit_bias": {t: BAN_BIAS for t in fmt.banned}} \
        if "logprobs" in variant else {}
    digest = {id(im): image_uuid(im) for row in images for im in row}  # the rollout's ids
    start = time.perf_counter()
    for k in range(args.turns):
        reqs = [{"prompt_token_ids": ids[i], "multi_modal_data": {"image": images[i][:k + 1]}}
                for i in range(B)]
        if "uuids" in variant:
            for i, req in enumerate(reqs):
                req["multi_modal_uuids"] = {"image": [digest[id(im)] for im in images[i][:k + 1]]}
        params = [VParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True,
                          detokenize=False, seed=1000 * i + k, **extra) for i in range(B)]
        outs = engine.llm.generate(reqs, params, lora_request=lora, use_tqdm=False)
        for i, o in enumerate(outs):
            ids[i] = ids[i] + list(o.outputs[0].token_ids) + close_ids + user_ids
    return {"rollout_s": time.perf_counter() - start, "lora": lora is not None,
            "final_prompt_tokens": len(outs[0].prompt_token_ids)}


def bench_step(session: Any, args: Any, device: torch.device) -> dict[str, Any]:
    """GRPO steps through the session (benchmarks/gpu.py's grpo_step): warm-up, then median."""
    host = session.host
    facts = gpu.model_facts(host)
    facts["vision_flops_per_patch"] = gpu.vision_flops_per_patch(host)
    _, _, minibatch = gpu.set_trainer(host, args.update)
    runs = []
    for r in range(1 + args.step_repeats):
        res = gpu.grpo_step(session, gpu.seed_config(args), args.mazes, args.group,
                            args.max_tokens, minibatch, seed=r, device=device, facts=facts,
                            peak_flops=args.peak_tflops * 1e12, recompute=False)
        gpu.print_step("  warm-up step" if r == 0 else f"  step {r}", res)
        runs.append(res)
    timed_runs = runs[1:] or runs
    med = {k: statistics.median(x[k] for x in timed_runs) if isinstance(v, float) else v
           for k, v in timed_runs[0].items()}
    out = {"median": med, "runs": runs, "update_variant": args.update}
    if args.profile_update:
        weighted, summed = gpu.update_datums(session, args)
        out["profile"] = gpu.profile_update(session.training_client, weighted[:minibatch],
                                            summed, Path(args.out))
    return out


def run_engine(name: str, model: str, args: Any, device: torch.device, out: Path) -> None:
    """Every section for one engine, in its own session (closed and freed at the end)."""
    res: dict[str, Any] = RESULTS.setdefault("engines", {}).setdefault(name, {})
    t0 = time.perf_counter()
    session = create_session(session_spec(args, model, name))
    res["session_up_s"] = time.perf_counter() - t0
    gpu.log(f"{name}: session up in {res['session_up_s']:.0f} s")
    try:
        res["decode"] = bench_decode(session.host, args, device)
        d = res["decode"]
        gpu.log(f"{name}: batch-{d['rows']} decode {d['decode_ms_per_step']:.2f} ms/step = "
                f"{d['decode_tokens_per_s']:,.0f} tok/s")
        save(out)
        res["rollout"] = bench_rollout(session, args, device)
        r = res["rollout"]
        episodes = r.pop("episodes")  # kept for the anchor, not written to the JSON
        gpu.log(f"{name}: rollout {r['rollout_s']:.2f} s ({r['turns']} turns, "
                f"{r['sampled_tokens_per_s']:,.0f} sampled tok/s); {r['speed_metrics']}")
        save(out)
        if name == "vllm":
            res["anchor"] = {}
            for variant in args.anchor_variants:
                a = bench_anchor(session.host.engine, session.host, args, episodes, variant)
                res["anchor"][variant] = a
                gpu.log(f"{name}: vLLM's own loop ({variant}; no env, no workbench code) "
                        f"{a['rollout_s']:.2f} s")
            save(out)
        if name in args.step_engines:
            if time.perf_counter() - gpu.T0 > args.deadline:
                gpu.log(f"{name}: step skipped, past the {args.deadline:.0f} s deadline")
            else:
                res["step"] = bench_step(session, args, device)
                save(out)
    finally:
        session.close()
        del session
        free_memory()


def summary() -> None:
    print("\n=== side by side ===")
    engines = RESULTS.get("engines", {})
    for name, r in engines.items():
        line = f"{name:12s}"
        if "decode" in r:
            line += (f" decode {r['decode']['decode_ms_per_step']:6.2f} ms/step "
                     f"({r['decode']['decode_tokens_per_s']:8,.0f} tok/s)")
        if "rollout" in r:
            line += f" | rollout {r['rollout']['rollout_s']:6.2f} s"
            hit = r["rollout"]["speed_metrics"].get("vllm/prefix_cache_hit_rate")
            line += f" (prefix cache hit {100 * hit:.1f}%)" if hit is not None else ""
        for variant, a in r.get("anchor", {}).items():
            line += f" | vLLM alone ({variant}) {a['rollout_s']:.2f} s"
        print(line)
        if "step" in r:
            m = r["step"]["median"]
            print(f"{'':12s} step {m['step_s']:.2f} s = handoff {m['handoff_s']:.2f} + rollout "
                  f"{m['rollout_s']:.2f} + update {m['update_s']:.2f} (MFU {m['mfu_pct']:.1f}%, "
                  f"{r['step']['update_variant']}); peak trainer {m['trainer_peak_gb']:.1f} GB")
            if m.get("rollout_gpu_busy_s") == m.get("rollout_gpu_busy_s"):  # NVML: not nan
                print(f"{'':12s} GPU busy (NVML, any process): rollout "
                      f"{m['rollout_gpu_busy_s']:.2f} s + update {m['update_gpu_busy_s']:.2f} s")
    if {"transformers", "vllm"} <= engines.keys():
        a, b = engines["transformers"], engines["vllm"]
        if "rollout" in a and "rollout" in b:
            roll = a["rollout"]["rollout_s"] / b["rollout"]["rollout_s"]
            dec = a["decode"]["decode_ms_per_step"] / b["decode"]["decode_ms_per_step"]
            print(f"ours / vLLM: rollout {roll:.2f}x, decode step {dec:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-vl-8b-shape")
    ap.add_argument("--folder", default="/tmp/side-by-side-model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="/tmp/side-by-side")
    ap.add_argument("--workdir", default="/tmp/side-by-side-work")
    ap.add_argument("--engines", type=lambda s: s.split(","), default=["transformers", "vllm"])
    ap.add_argument("--step-engines", type=lambda s: s.split(","), default=["vllm"])
    ap.add_argument("--anchor-variants", type=lambda s: s.split(","),
                    default=list(ANCHOR_VARIANTS), help=f"of {', '.join(ANCHOR_VARIANTS)}")
    ap.add_argument("--memory", type=float, default=0.3, help="vLLM's GPU memory share")
    ap.add_argument("--vllm-lora", default="adapter", choices=("adapter", "merged"),
                    help="generator.vllm_lora: LoRA kernels, or the adapter merged into vLLM")
    ap.add_argument("--mazes", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--step-repeats", type=int, default=2)
    ap.add_argument("--update", default="none-bf16-4-c",
                    help="benchmarks/gpu.py's CKPT-LORA-MB[-c]")
    ap.add_argument("--compile-layers", action="store_true",
                    help="build the trainer with compiled layers (--update ...-c compiles anyway)")
    ap.add_argument("--profile-update", action="store_true",
                    help="after the steps: one forward_backward call under torch.profiler")
    ap.add_argument("--peak-tflops", type=float, default=788.0, help="bf16 matmul peak for MFU")
    ap.add_argument("--deadline", type=float, default=480.0, help="skip later steps after (s)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU dry run)")
    args = ap.parse_args()
    if args.quick:
        args.mazes, args.group, args.turns, args.decode_tokens = 2, 2, 3, 4
        args.repeats, args.step_repeats, args.update = 1, 1, "none-fp32-2"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    import transformers
    RESULTS["env"] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    gpu.log(f"env: {RESULTS['env']}")
    model = save_shape(args.shape, Path(args.folder), args.device,
                       "bfloat16" if device.type == "cuda" else "float32")
    gpu.log(f"{args.shape} saved to {model}")
    for name in args.engines:
        try:
            run_engine(name, model, args, device, out)
        except Exception as err:  # noqa: BLE001 - the other engine still runs; the error is kept
            RESULTS.setdefault("engines", {}).setdefault(name, {})["error"] = repr(err)[:500]
            gpu.log(f"{name}: FAILED {err!r}")
        save(out)
    RESULTS["total_s"] = time.perf_counter() - gpu.T0
    save(out)
    summary()


if __name__ == "__main__":
    main()
