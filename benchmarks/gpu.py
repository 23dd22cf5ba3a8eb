"""GPU benchmark: the seed's shape (Qwen3-VL-8B architecture, random bf16 weights, LoRA r32) on one
GPU, through the workbench's own code (our sampler and engines, the session's forward_backward with
our losses, its weight-version handoff). Prints everything; writes gpu.json (and the log) to --out.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py --out $OUT                  # H200, everything
    python benchmarks/gpu.py --shape qwen3-vl-small-shape --device cpu --quick  # CPU dry run

Sections (--sections): ceilings (copy bandwidth, bf16 matmul), decode (prefill and decode
tokens/s of each --decode-variants: graphs = transformers + peft replayed as CUDA graphs, fused =
merged LoRA + fused projections replayed, compiled = fused + torch.compile; batch 64 and 1, short
and long context, % of the bandwidth bound, the graph's GPU time alone), update (forward_backward
of the same 32 episodes under each --update-variants CKPT-LORA-MB[-c]: checkpointing full / sac /
none, LoRA fp32 / bf16, mini-batch, compiled layers; --profile: the kernels of one call), step (one
GRPO step of 8 mazes x 8 samples, 15 turns, easy 9x9 at 25 px: per phase, update tokens/s and
MFU, peak memory of sampler and trainer, adapter handoff), turns (one step at each
--scan-turns), scale (group 4/8/16 x easy/hard).
Timing: CUDA events after a synchronize (host clock on the CPU), after warm-up; medians.

    python3 benchmarks/gpu.py --out $OUT --sections ceilings,update,step,scale --decode compiled \
        --update-variants none-bf16-4-c --profile            # run 8: the seed preset's settings

A random model earns no reward, so every group has zero variance; as in benchmarks/bench.py the
update gets advantages +-1 by episode parity (the same work as with real signal). Its replies are
unparseable (ids beyond the tiny tokenizer decode to nothing) and it never emits <|im_end|>, so
every episode plays all 15 turns with full-length replies: the upper bound of the seed's shape.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workbench.envs import MazeConfig, MazeEnv, eval_set, system_prompt  # noqa: E402
from workbench.model import LoraSettings  # noqa: E402
from workbench.model.presets import lora_param_count, param_counts  # noqa: E402
from workbench.policy import SamplingParams, append_user, encode_image, start_stream  # noqa: E402
from workbench.rl import phases  # noqa: E402
from workbench.rl.rollout import user_text  # noqa: E402
from workbench.session.host import make_host  # noqa: E402
from workbench.session.inprocess import Session  # noqa: E402
from workbench.session.losses import LossConfig  # noqa: E402
from workbench.session.spec import SessionSpec, SpeedSettings  # noqa: E402
from workbench.session.types import AdamParams, datum_from_stream  # noqa: E402

RESULTS: dict[str, Any] = {}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device) -> tuple[Any, float]:
    """(fn(), seconds): CUDA events around fn after a synchronize; host clock on the CPU."""
    sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    return out, begin.elapsed_time(end) / 1000.0


class GpuBusy:
    """How long the GPU ran kernels of any process (vLLM's engine process too) in a window:
    NVML's utilization samples (each the share of its sample period in which a kernel ran),
    read in a thread every 0.5 s so the driver's sample buffer cannot overflow.

        with GpuBusy(device) as busy: work()
        busy.seconds, busy.pct        # nan when NVML is not there (one line says so)
    """

    told = False

    def __init__(self, device: torch.device) -> None:
        self.device, self.pct, self.seconds = device, float("nan"), float("nan")
        self.samples: dict[int, int] = {}

    def _nvml(self) -> Any:
        if self.device.type != "cuda":
            return None
        try:
            from vllm.third_party import pynvml  # vLLM's copy: the GPU machine has no other
        except ImportError:
            try:
                import pynvml  # type: ignore[no-redef]
            except ImportError:
                if not GpuBusy.told:
                    log("GPU busy: no pynvml here, so no busy figures")
                    GpuBusy.told = True
                return None
        pynvml.nvmlInit()
        return pynvml

    def _read(self) -> None:
        nv = self.nvml
        _, samples = nv.nvmlDeviceGetSamples(self.handle, nv.NVML_GPU_UTILIZATION_SAMPLES,
                                             self.since_us)
        for s in samples:
            if s.timeStamp >= self.since_us:
                self.samples[s.timeStamp] = s.sampleValue.uiVal

    def _poll(self) -> None:
        while not self.stop.wait(0.5):
            self._read()

    def __enter__(self) -> GpuBusy:
        import threading
        self.nvml = self._nvml()
        if self.nvml is not None:
            self.handle = self.nvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self.since_us, self.start = int(time.time() * 1e6), time.perf_counter()
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._poll, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.nvml is None:
            return
        sync(self.device)
        wall = time.perf_counter() - self.start
        self.stop.set()
        self.thread.join()
        self._read()
        if self.samples:
            self.pct = statistics.mean(self.samples.values())
            self.seconds = wall * self.pct / 100


def peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else float("nan")


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def save(out: Path) -> None:
    (out / "gpu.json").write_text(json.dumps(RESULTS, indent=1, default=str))


# ------------------------------------------------------------------------------------ ceilings


def ceilings(device: torch.device, quick: bool) -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate."""
    n = 2**24 if quick else 2**30  # bf16 elements: 2 GiB a buffer on the GPU
    x = torch.randn(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    copies = []
    for r in range(23 if not quick else 4):
        _, s = timed(partial(y.copy_, x), device)
        if r >= 3 or quick:
            copies.append(s)
    copy_bw = 2 * x.numel() * 2 / statistics.median(copies)
    del x, y
    m = 1024 if quick else 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    mms = []
    for r in range(23 if not quick else 4):
        _, s = timed(partial(torch.matmul, a, b), device)
        if r >= 3 or quick:
            mms.append(s)
    rate = 2 * m**3 / statistics.median(mms)
    return {"copy_bytes_per_s": copy_bw, "bf16_matmul_flops": rate, "matmul_n": m,
            "copy_gib": n * 2 / 2**30}


# ------------------------------------------------------------------------------------ model


def model_facts(host: Any) -> dict[str, Any]:
    """Parameter counts and the bytes one decode step must read (weights part)."""
    base = host.lm.model.get_base_model()
    cfg = base.config
    counts = param_counts(cfg)
    lora = sum(p.numel() for p in host.lm.model.parameters() if p.requires_grad)
    lora_bytes = sum(p.numel() * p.element_size() for p in host.lm.model.parameters()
                     if p.requires_grad)
    elt = next(base.parameters()).element_size()
    t = cfg.text_config
    kv_per_token = t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * elt
    # a decode step reads every text matrix, the lm_head, the norms and the LoRA factors once
    weight_read = (counts["text_linear"] + counts["lm_head"] + counts["text_norms"]) * elt
    weight_read += lora_bytes
    return {"params": counts, "lora_params": lora, "lora_params_formula":
            lora_param_count(cfg, host.lora.rank), "lora_bytes": lora_bytes,
            "dtype_bytes": elt, "kv_bytes_per_token": kv_per_token,
            "decode_weight_bytes": weight_read, "vocab": t.vocab_size, "hidden": t.hidden_size,
            "layers": t.num_hidden_layers, "heads": t.num_attention_heads,
            "head_dim": t.head_dim}


# ------------------------------------------------------------------------------------ decode


def first_prompts(host: Any, config: MazeConfig, n: int, extra_tokens: int = 0) -> list:
    """n first-turn prompts (system + image + text) of eval mazes; `extra_tokens` one-token words
    appended to the text to make a long context."""
    proc, fmt = host.lm.processor, host.fmt
    out = []
    for state in eval_set(config.size, n):
        env = MazeEnv(config)
        obs, info = env.reset(options={"init_state": state})
        s = start_stream(proc, fmt, system_prompt(config))
        text = user_text(obs, info, config) + " up" * extra_tokens
        out.append(append_user(s, proc, fmt, text, encode_image(proc, obs["image"])))
    return out


def bench_decode(host: Any, engine: Any, prompts: list, n: int, tokens: int, repeats: int,
                 device: torch.device, facts: dict, bw: float,
                 merged: bool = False) -> dict[str, float]:
    """Prefill (engine.open) and fixed-length decode (<|im_end|> never stops it): medians."""
    engine.fmt = replace(host.fmt, im_end=-1)
    params = SamplingParams(max_tokens=tokens, temperature=1.0)
    prompt_tokens = sum(len(s) for s in prompts)
    pre, dec = [], []
    rows = None
    for r in range(repeats + 1):  # the first run warms up (and captures graphs)
        rows, s_pre = timed(partial(engine.open, prompts, n), device)
        gen = torch.Generator().manual_seed(r)
        _, s_dec = timed(partial(rows.decode, params, gen), device)
        if r > 0:
            pre.append(s_pre)
            dec.append(s_dec)
    engine.fmt = host.fmt
    B = len(prompts) * n
    replay_ms = replay_time_ms(getattr(engine, "static", None), B, device)
    ctx = rows.live.mask_BL.shape[1]  # cache columns at the end (prompt + decoded)
    step_s = statistics.median(dec) / (tokens - 1)  # forward steps: tokens - 1 feeds
    mean_ctx = ctx - tokens / 2
    kv_bytes = B * mean_ctx * facts["kv_bytes_per_token"]
    weight_bytes = facts["decode_weight_bytes"] - (facts["lora_bytes"] if merged else 0)
    bound_s = (weight_bytes + kv_bytes) / bw
    del rows
    return {"rows": B, "prompt_tokens_per_row": prompt_tokens / len(prompts),
            "prefill_tokens_per_s": prompt_tokens / statistics.median(pre),
            "prefill_s": statistics.median(pre),
            "decode_tokens_per_s": B * tokens / statistics.median(dec),
            "decode_ms_per_step": 1000 * step_s, "context_tokens": ctx,
            "kv_gb_read_per_step": kv_bytes / 1e9,
            "bound_ms_per_step": 1000 * bound_s, "pct_of_bandwidth_bound": 100 * bound_s / step_s,
            "replay_ms": replay_ms, "replay_pct_of_bound": 100 * bound_s * 1000 / replay_ms
            if replay_ms else float("nan")}


def replay_time_ms(static: Any, rows: int, device: torch.device) -> float:
    """The GPU time of one step's graph alone (widest window captured for `rows` rows):
    median of 20 replays (each rewrites the same KV column). 0.0 without graphs."""
    if static is None or not static.use_graphs or device.type != "cuda":
        return 0.0
    keys = [k for k in static.graphs if k[0] == rows and k[2] == static.generation]
    if not keys:
        return 0.0
    graph, _ = static.graphs[max(keys, key=lambda k: k[1])]
    times = [timed(graph.replay, device)[1] for _ in range(21)][1:]
    return 1000 * statistics.median(times)


def set_decode(host: Any, variant: str, made: dict) -> None:
    """Switch the engine's decode step: graphs (transformers + peft, replayed), fused (merged LoRA,
    fused projections, replayed) or compiled (fused, torch.compile'd, replayed). Graphs are
    re-captured; the fused weights and the compiled step are made once (`made`)."""
    from workbench.policy.fused import compiled_layer_step, fuse_weights, layer_step
    from workbench.policy.graphs import reset_graphs

    st = host.engine.static
    if variant != "graphs" and "fused" not in made:
        made["fused"] = fuse_weights(host.lm.model)
    if variant == "compiled" and "compiled" not in made:
        made["compiled"] = compiled_layer_step()
    st.fused = None if variant == "graphs" else made["fused"]
    st.layer_step = made["compiled"] if variant == "compiled" else layer_step
    host.engine.use_version(0)  # the weights do not change here: merge once per variant
    if st.fused is not None:
        st.fused.version = None
    reset_graphs(st)


def section_decode(host: Any, args: Any, device: torch.device, facts: dict, bw: float) -> None:
    """Each decode variant on each case; the bound of a fused variant counts no LoRA bytes
    (its adapter is merged), so its % is against the smaller, stricter bound."""
    config = MazeConfig(size=9, px_per_cell=25, grammar="tuple", max_turns=15)
    out = RESULTS.setdefault("decode", {})
    tokens = 9 if args.quick else 33
    repeats = 1 if args.quick else 3
    cases = [("b64_short", 8, 8, 0), ("b1_short", 1, 1, 0), ("b64_long", 8, 8, 1400),
             ("b1_long", 1, 1, 1400)]
    if args.quick:
        cases = [("b64_short", 2, 2, 0), ("b1_short", 1, 1, 0), ("b64_long", 2, 2, 100)]
    made: dict = {}
    st = host.engine.static
    for variant in args.decode_variants:
        set_decode(host, variant, made)
        for name, P, n, extra in cases:
            if time.perf_counter() - T0 > args.deadline:
                log(f"decode: deadline reached, skipping {name} {variant}")
                continue
            prompts = first_prompts(host, config, P, extra)
            merged = variant != "graphs"
            reset_peak(device)
            r = bench_decode(host, host.engine, prompts, n, tokens, repeats, device, facts, bw,
                             merged)
            r["peak_gb"] = peak_gb(device)
            out[f"{name}_{variant}"] = r
            log(f"decode {name:10s} {variant:8s}: prefill {r['prefill_tokens_per_s']:10,.0f} "
                f"tok/s | decode {r['decode_tokens_per_s']:9,.0f} tok/s, "
                f"{r['decode_ms_per_step']:7.2f} ms/step, bound {r['bound_ms_per_step']:.2f} ms "
                f"-> {r['pct_of_bandwidth_bound']:5.1f}% (ctx {r['context_tokens']}); graph "
                f"alone {r['replay_ms']:.2f} ms = {r['replay_pct_of_bound']:.1f}%")
        out[f"graphs_{variant}"] = {"captures": st.captures, "capture_s": st.capture_seconds,
                                    "use_graphs": st.use_graphs, "error": st.error,
                                    "compile_error": st.compile_error}
        log(f"decode {variant}: graphs {st.use_graphs} {st.error} | captures {st.captures} "
            f"({st.capture_seconds:.1f} s so far) | compile error: {st.compile_error[:300]}")
    set_decode(host, args.decode, made)


# ------------------------------------------------------------------------------------ update


def seed_config(args: Any, size: int = 9) -> MazeConfig:
    return MazeConfig(size=size, px_per_cell=25, grammar="tuple", max_turns=args.turns,
                      reward="stop_on_goal", format_weight=0.2)


def set_trainer(host: Any, variant: str) -> tuple[str, bool, int]:
    """Apply an update variant "CKPT-LORA-MB[-c][-hfv]": CKPT full | sac (selective: keep
    matmuls) | none, LORA bf16 (autocast) | fp32 (peft's path), MB episodes a forward_backward
    call, c: decoder layers torch.compile'd for the update (once on, it stays on), hfv: the vision
    tower attends image by image (transformers' loop) instead of one call a layer."""
    from workbench.model.vision import batch_vision_attention
    from workbench.session.gpu import compile_for_training, set_checkpointing

    ckpt, lora, mb, *flags = variant.split("-")
    if "c" in flags:
        compile_for_training(host.lm.model)
    batch_vision_attention(host.lm.model, on="hfv" not in flags)
    if ckpt not in ("full", "sac", "none") or lora not in ("bf16", "fp32"):
        raise ValueError(f"update variant {variant!r}: want full|sac|none-bf16|fp32-N")
    set_checkpointing(host.lm.model, ckpt != "none", selective=ckpt == "sac")
    host.speed = replace(host.speed, lora_autocast=lora == "bf16")  # a variant, measured
    return ckpt, lora == "bf16", int(mb)


def section_update(session: Session, args: Any, device: torch.device, facts: dict,
                   peak: float) -> None:
    """forward_backward of the same 32 episodes (one rollout, every other episode) under each
    trainer setting: checkpointing on/off, LoRA float32 (peft) / bf16 (autocast), mini-batch."""
    tc, host = session.training_client, session.host
    weighted, summed = update_datums(session, args)
    half = weighted[::2]
    flops = train_flops(half, facts, facts["vision_flops_per_patch"])
    out = RESULTS.setdefault("update", {"tokens": flops["tokens"], "episodes": len(half),
                                        "model_tflop": flops["model_flops"] / 1e12})
    warm = False
    for name in args.update_variants:
        if time.perf_counter() - T0 > args.deadline:
            log(f"update: deadline reached, skipping {name}")
            continue
        ckpt, _, mb = set_trainer(host, name)

        def fb(mb=mb):
            return [tc.forward_backward(half[i:i + mb], "ppo", summed).result()
                    for i in range(0, len(half), mb)]
        try:
            if "c" in name.split("-")[3:]:  # compile (and warm up) outside the timing
                _, s_compile = timed(partial(fb_call, tc, half[:mb], summed), device)
                log(f"update {name}: first call (compiles) {s_compile:.1f} s")
            if not warm:
                tc.forward_backward(half[:2], "ppo", summed).result()
                warm = True
            host.lm.model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            reset_peak(device)
            outs, s = timed(fb, device)
        except torch.OutOfMemoryError as err:
            host.lm.model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            out[name] = {"oom": str(err)[:200]}
            log(f"update {name}: out of memory")
            continue
        # recomputed FLOPs: full checkpointing repeats the forward; selective only elementwise
        hw = flops["hardware_flops"] if ckpt == "full" else flops["model_flops"]
        r = {"s": s, "tokens_per_s": flops["tokens"] / s,
             "mfu_pct": 100 * flops["model_flops"] / s / peak, "hfu_pct": 100 * hw / s / peak,
             "peak_gb": peak_gb(device), "loss": sum(o.loss for o in outs),
             "kl": statistics.mean(o.metrics["kl_sampler_trainer"] for o in outs)}
        out[name] = r
        log(f"update {name:14s}: {s:6.2f} s, {r['tokens_per_s']:7,.0f} tok/s, MFU "
            f"{r['mfu_pct']:5.1f}% HFU {r['hfu_pct']:5.1f}%, peak {r['peak_gb']:6.1f} GB, "
            f"loss {r['loss']:.4f} kl {r['kl']:.2e}")
        save(Path(args.out))
    host.lm.model.zero_grad(set_to_none=True)
    fits = {k: r for k, r in out.items() if isinstance(r, dict) and "s" in r
            and not r["peak_gb"] >= args.max_update_gb}  # nan on the CPU
    if args.update == "best" and fits:
        args.update = min(fits, key=lambda k: fits[k]["s"])
        log(f"update: the step and scale sections use {args.update} (fastest under "
            f"{args.max_update_gb:.0f} GB)")
    RESULTS["update"]["chosen"] = args.update
    _, _, args.minibatch = set_trainer(host, args.update)
    if args.profile:
        profile_update(tc, half[:args.minibatch], summed, Path(args.out))


def update_datums(session: Session, args: Any) -> tuple[list, LossConfig]:
    """The seed-shape rollout's episodes as update datums (advantage +-1 by parity: a random
    model earns no reward), weighted for a sequence-mean loss and sorted by length, and the
    summed loss that forward_backward calls over slices of them take."""
    sampler = session.training_client.save_weights_and_get_sampling_client()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    ro = phases.rollout(sampler, seed_config(args), eval_set(9, args.mazes), args.group, params,
                        99)
    datums = [datum_from_stream(ep.stream, 1.0 if k % 2 else -1.0)
              for k, ep in enumerate(ro.flat)]
    loss = LossConfig(reduction="sequence_mean")
    weighted = sorted(phases.global_weights(datums, loss.reduction), key=lambda d: len(d.stream))
    return weighted, replace(loss, reduction="sum")


def fb_call(tc: Any, datums: list, loss: Any) -> Any:
    return tc.forward_backward(datums, "ppo", loss).result()


def profile_update(tc: Any, datums: list, loss: Any, out: Path) -> dict[str, float]:
    """torch.profiler over one forward_backward call: the kernels that take the time, and how
    much of the call's wall time (timed again without the profiler) the GPU is busy."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _, wall_s = timed(lambda: fb_call(tc, datums, loss), device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fb_call(tc, datums, loss)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    averages = prof.key_averages()
    kernel_s = sum(getattr(e, "self_device_time_total", 0.0) for e in averages) / 1e6
    table = averages.table(sort_by="self_cuda_time_total", row_limit=40,
                           max_name_column_width=70)
    (out / "profile_update.txt").write_text(table)
    log(f"profile of one forward_backward call of {len(datums)} episodes: wall {wall_s:.3f} s "
        f"(no profiler), kernels {kernel_s:.3f} s = GPU busy {100 * kernel_s / wall_s:.0f}%; "
        "top kernels by self CUDA time:\n" + "\n".join(table.splitlines()[:28]))
    return {"wall_s": wall_s, "kernel_s": kernel_s, "episodes": len(datums)}


# ------------------------------------------------------------------------------------ GRPO step


def train_flops(datums: list, facts: dict, vision_flops_per_patch: float) -> dict[str, float]:
    """Model FLOPs of one update (forward + backward; LoRA: the base's weight grads are not
    computed) and the hardware FLOPs with gradient checkpointing's recomputed forward.

    per token: forward 2 N_text, backward (activation grads) 2 N_text, LoRA 6 N_lora;
    per loss token: lm_head 2 V d forward + 2 V d backward; attention (causal) 2 L^2 H d_head
    per layer forward, twice that backward; vision tower forward only (frozen, no grad)."""
    p = facts["params"]
    n_text, n_lora = p["text_linear"], facts["lora_params"]
    V, d = facts["vocab"], facts["hidden"]
    tokens = sum(len(x.stream) for x in datums)
    kept = sum(sum(1 for w in x.weights_T if w != 0) for x in datums)
    attn_fwd = sum(2 * len(x.stream) ** 2 * facts["heads"] * facts["head_dim"] * facts["layers"]
                   for x in datums)
    patches = sum(int(im.grid_thw.prod()) for x in datums for im in x.stream.images)
    vision = vision_flops_per_patch * patches
    fwd = 2 * n_text * tokens + 2 * n_lora * tokens + 2 * V * d * kept + attn_fwd
    model = fwd + (2 * n_text * tokens + 4 * n_lora * tokens + 2 * V * d * kept + 2 * attn_fwd)
    model += vision
    recompute = 2 * n_text * tokens + 2 * n_lora * tokens + attn_fwd + vision
    return {"tokens": tokens, "loss_tokens": kept, "model_flops": model,
            "hardware_flops": model + recompute, "vision_flops": vision, "attn_fwd": attn_fwd,
            "images": sum(len(x.stream.images) for x in datums)}


def grpo_step(session: Session, config: MazeConfig, P: int, G: int, max_tokens: int,
              minibatch: int, seed: int, device: torch.device, facts: dict,
              peak_flops: float, recompute: bool = True) -> dict[str, float]:
    """One GRPO step through the session, timed per phase (recompute: full checkpointing is on,
    for the hardware-FLOP count)."""
    tc, host = session.training_client, session.host
    static = getattr(host.engine, "static", None)
    caps0 = (static.captures, static.capture_seconds) if static else (0, 0.0)
    states = [s for s in eval_set(config.size, 64)][seed % 8 * 8:][:P]
    if len(states) < P:
        states = eval_set(config.size, P)
    sampler, handoff = timed(tc.save_weights_and_get_sampling_client, device)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    reset_peak(device)
    session.speed_metrics().result()  # vLLM's counters from here on
    with GpuBusy(device) as roll_busy:
        ro, s_roll = timed(lambda: phases.rollout(sampler, config, states, G, params, seed),
                           device)
    sampler_peak = peak_gb(device)
    inside_s = session.speed_metrics().result().get("vllm/generate_s", float("nan"))
    sc, s_score = timed(lambda: phases.score(ro), device)
    adv, s_adv = timed(lambda: phases.advantages(sc.rewards_P_G, "grpo"), device)
    datums = [datum_from_stream(ep.stream, 1.0 if k % 2 else -1.0)  # no reward: +-1 by parity
              for k, ep in enumerate(ro.flat)]
    loss = LossConfig(reduction="sequence_mean")
    weighted = sorted(phases.global_weights(datums, loss.reduction), key=lambda d: len(d.stream))
    summed = replace(loss, reduction="sum")
    reset_peak(device)

    def fb():
        futures = [tc.forward_backward(weighted[i:i + minibatch], "ppo", summed)
                   for i in range(0, len(weighted), minibatch)]
        return [f.result() for f in futures]

    with GpuBusy(device) as update_busy:
        outs, s_fb = timed(fb, device)
        opt, s_opt = timed(lambda: tc.optim_step(AdamParams(learning_rate=1e-6)).result(),
                           device)
    trainer_peak = peak_gb(device)
    flops = train_flops(datums, facts, facts["vision_flops_per_patch"])
    s_update = s_fb + s_opt
    turns = [ep.turns for ep in ro.flat]
    sampled = sum(sum(ep.stream.loss_mask_T) for ep in ro.flat)
    caps = (static.captures - caps0[0], static.capture_seconds - caps0[1]) if static else (0, 0)
    return {
        "P": P, "G": G, "size": config.size, "px": config.px_per_cell,
        "handoff_s": handoff, "rollout_s": s_roll, "rollout_in_vllm_generate_s": inside_s,
        "score_s": s_score, "advantages_s": s_adv,
        "forward_backward_s": s_fb, "optim_step_s": s_opt, "update_s": s_update,
        "step_s": handoff + s_roll + s_score + s_adv + s_update,
        "graph_captures_in_rollout": caps[0], "graph_capture_s_in_rollout": caps[1],
        "turns_mean": statistics.mean(turns), "episode_tokens_mean":
        statistics.mean(len(ep.stream) for ep in ro.flat), "episode_tokens_max":
        max(len(ep.stream) for ep in ro.flat), "sampled_tokens": sampled,
        "sampled_tokens_per_s": sampled / s_roll,
        "update_tokens": flops["tokens"], "update_tokens_per_s": flops["tokens"] / s_update,
        "loss_tokens": flops["loss_tokens"], "images": flops["images"],
        "model_tflop": flops["model_flops"] / 1e12, "hardware_tflop":
        flops["hardware_flops"] / 1e12, "vision_tflop": flops["vision_flops"] / 1e12,
        "mfu_pct": 100 * flops["model_flops"] / s_update / peak_flops,
        # hardware FLOPs add full checkpointing's recomputed forward (selective and none: 0)
        "hfu_pct": 100 * flops["hardware_flops" if recompute else "model_flops"] / s_update
        / peak_flops,
        "sampler_peak_gb": sampler_peak, "trainer_peak_gb": trainer_peak,
        # NVML: the seconds in which a kernel of any process ran (vLLM's engine process too)
        "rollout_gpu_busy_pct": roll_busy.pct, "rollout_gpu_busy_s": roll_busy.seconds,
        "update_gpu_busy_pct": update_busy.pct, "update_gpu_busy_s": update_busy.seconds,
        "kv_pool_gb": kv_pool_gb(static), "grad_norm": opt.grad_norm,
        "loss": sum(o.loss for o in outs),
        "kl_sampler_trainer": statistics.mean(o.metrics["kl_sampler_trainer"] for o in outs),
    }


def kv_pool_gb(static: Any) -> float:
    """Bytes held by the sampler's KV pool (all layers, keys and values)."""
    if static is None:
        return 0.0
    return sum(t.numel() * t.element_size() for layer in static.cache.layers
               for t in (layer._k, layer._v) if t is not None) / 1e9


def print_step(tag: str, r: dict) -> None:
    log(f"{tag}: step {r['step_s']:.2f} s = handoff {r['handoff_s']:.3f} + rollout "
        f"{r['rollout_s']:.2f} (in vLLM's generate {r['rollout_in_vllm_generate_s']:.2f}; "
        f"captures {r['graph_captures_in_rollout']}, "
        f"{r['graph_capture_s_in_rollout']:.2f} s) + score {r['score_s']:.4f} + adv "
        f"{r['advantages_s']:.4f} + fwd_bwd {r['forward_backward_s']:.2f} + optim "
        f"{r['optim_step_s']:.3f}")
    log(f"    {r['P']}x{r['G']} size {r['size']}: turns {r['turns_mean']:.1f}, episode tokens "
        f"{r['episode_tokens_mean']:.0f} (max {r['episode_tokens_max']}), sampled "
        f"{r['sampled_tokens_per_s']:,.0f} tok/s; update {r['update_tokens_per_s']:,.0f} tok/s, "
        f"MFU {r['mfu_pct']:.1f}% (HFU {r['hfu_pct']:.1f}%); peak GB sampler "
        f"{r['sampler_peak_gb']:.1f} trainer {r['trainer_peak_gb']:.1f} (KV pool "
        f"{r['kv_pool_gb']:.1f}); kl "
        f"{r['kl_sampler_trainer']:.2e}")
    if r["rollout_gpu_busy_s"] == r["rollout_gpu_busy_s"]:  # not nan: NVML was there
        log(f"    GPU busy (NVML, any process): rollout {r['rollout_gpu_busy_s']:.2f} s "
            f"({r['rollout_gpu_busy_pct']:.0f}%), update {r['update_gpu_busy_s']:.2f} s "
            f"({r['update_gpu_busy_pct']:.0f}%)")


def section_step(session: Session, args: Any, device: torch.device, facts: dict,
                 peak: float) -> None:
    config = seed_config(args)
    runs = []
    for r in range(1 + args.step_repeats):  # the first step warms up
        res = grpo_step(session, config, args.mazes, args.group, args.max_tokens,
                        args.minibatch, seed=r, device=device, facts=facts, peak_flops=peak,
                        recompute=args.update.startswith("full"))
        print_step("warm-up step" if r == 0 else f"step {r}", res)
        if r > 0:
            runs.append(res)
    if not runs:  # --step-repeats 0: a warm-up only (e.g. before a scale row)
        return
    med = {k: statistics.median(x[k] for x in runs) if isinstance(runs[0][k], float) else
           runs[0][k] for k in runs[0]}
    RESULTS["step"] = {"median": med, "runs": runs, "update_variant": args.update,
                       "decode_variant": args.decode}
    export, s_export = timed(lambda: session.training_client.export(
        Path(args.workdir) / "adapter", "adapter").result(), device)
    RESULTS["step"]["adapter_export_s"] = s_export
    RESULTS["step"]["adapter_mb"] = sum(
        f.stat().st_size for f in Path(export).rglob("*") if f.is_file()) / 1e6
    log(f"adapter export (PEFT folder, the handoff a separate vLLM sampler would load): "
        f"{s_export:.2f} s, {RESULTS['step']['adapter_mb']:.0f} MB")


def section_turns(session: Session, args: Any, device: torch.device, facts: dict,
                  peak: float) -> None:
    """The multi-turn cost at the seed shape: one GRPO step at each of --scan-turns (a warm-up
    step at the largest first, so every graph window is captured before timing)."""
    rows = RESULTS.setdefault("turns", [])
    turns = sorted(args.scan_turns)
    for k, t in enumerate([turns[-1]] + turns):
        args.turns = t
        res = grpo_step(session, seed_config(args), args.mazes, args.group, args.max_tokens,
                        args.minibatch, seed=20 + t, device=device, facts=facts,
                        peak_flops=peak, recompute=args.update.startswith("full"))
        res["turns"] = t
        print_step(f"turns {t}" + (" (warm-up)" if k == 0 else ""), res)
        if k > 0:
            rows.append(res)
        save(Path(args.out))


def section_scale(session: Session, args: Any, device: torch.device, facts: dict,
                  peak: float, deadline: float) -> None:
    rows = RESULTS.setdefault("scale", [])
    pairs = [(size, G) for size in args.scale_sizes for G in args.scale_groups]
    pairs.sort(key=lambda p: p[1] > 8)  # the KV pool grows for G=16 and stays grown: last
    for size, G in pairs:
        if time.perf_counter() - T0 > deadline:
            log(f"scale: deadline reached, skipping size {size} G {G}")
            rows.append({"size": size, "G": G, "skipped": "deadline"})
            continue
        try:
            res = grpo_step(session, seed_config(args, size), args.mazes, G, args.max_tokens,
                            args.minibatch, seed=10 + G, device=device, facts=facts,
                            peak_flops=peak, recompute=args.update.startswith("full"))
        except torch.OutOfMemoryError:  # a bigger pool beside the update: checkpoint instead
            session.host.lm.model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            log(f"scale size {size} G {G}: out of memory with {args.update}; now "
                f"{args.fallback_update}")
            args.update = args.fallback_update
            _, _, args.minibatch = set_trainer(session.host, args.update)
            res = grpo_step(session, seed_config(args, size), args.mazes, G, args.max_tokens,
                            args.minibatch, seed=10 + G, device=device, facts=facts,
                            peak_flops=peak, recompute=args.update.startswith("full"))
        res["update_variant"] = args.update
        print_step(f"scale size {size} G {G} ({args.update})", res)
        rows.append(res)
        save(Path(args.out))


# ------------------------------------------------------------------------------------ main


def vision_flops_per_patch(host: Any) -> float:
    """2 x vision parameters per patch (matmuls; the merger acts on merged tokens: counted at
    1/merge^2 of the patches)."""
    v = host.lm.model.get_base_model().config.vision_config
    p = param_counts(host.lm.model.get_base_model().config)["vision"]
    merger = (v.hidden_size * 4) ** 2 + v.hidden_size * 4 * v.out_hidden_size
    mergers = (1 + len(v.deepstack_visual_indexes)) * merger
    return 2 * (p - mergers - v.num_position_embeddings * v.hidden_size) + 2 * mergers / 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-vl-8b-shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="/tmp/workbench-gpu-bench")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--sections", default="ceilings,decode,update,step,scale")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU dry run)")
    ap.add_argument("--mazes", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--step-repeats", type=int, default=1)
    ap.add_argument("--scale-groups", type=lambda s: [int(x) for x in s.split(",")],
                    default=[4, 8, 16])
    ap.add_argument("--scale-sizes", type=lambda s: [int(x) for x in s.split(",")],
                    default=[9, 11])
    ap.add_argument("--kv-tokens", type=int, default=3072)
    ap.add_argument("--scan-turns", type=lambda s: [int(x) for x in s.split(",")],
                    default=[5, 10, 15], help="turns section: max_turns values")
    ap.add_argument("--deadline", type=float, default=500.0, help="skip scale rows after (s)")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--decode-variants", type=lambda s: s.split(","),
                    default=["graphs", "fused", "compiled"])
    ap.add_argument("--decode", default="compiled", choices=["graphs", "fused", "compiled"],
                    help="the decode step of the step and scale sections")
    ap.add_argument("--update-variants", type=lambda s: s.split(","),
                    default=["full-fp32-16", "full-bf16-16", "sac-bf16-8", "none-bf16-4",
                             "none-bf16-4-c"])
    ap.add_argument("--update", default="best",
                    help="the update variant of the step and scale sections (CKPT-LORA-MB), or "
                         "best: the fastest of the update section under --max-update-gb")
    ap.add_argument("--max-update-gb", type=float, default=125.0)
    ap.add_argument("--fallback-update", default="none-bf16-2-c",
                    help="scale: the update variant after an out-of-memory (run 9: G=16)")
    ap.add_argument("--profile", action="store_true", help="profile one forward_backward call")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="workbench-gpu-")
    device = torch.device(args.device)
    sections = args.sections.split(",")
    import transformers
    RESULTS["env"] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "python": platform.python_version(),
                      "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    log(f"env: {RESULTS['env']}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    ceil = {"copy_bytes_per_s": 4.24e12, "bf16_matmul_flops": 788e12, "measured": False}
    if "ceilings" in sections:
        ceil = ceilings(device, args.quick) | {"measured": True}
        log(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), bf16 "
            f"matmul {ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s ({ceil['matmul_n']}^3)")
    RESULTS["ceilings"] = ceil
    save(out)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    speed = SpeedSettings(cuda_graphs=not args.no_graphs, kv_rows=args.mazes * args.group,
                          kv_tokens=args.kv_tokens, fused_decode=args.decode != "graphs",
                          compile_decode=args.decode == "compiled", loss_tokens_only=True,
                          lora_autocast=True)
    spec = SessionSpec(args.shape, LoraSettings(rank=32, alpha=64), args.workdir,
                       str(dtype).removeprefix("torch."), args.device, speed=speed)
    host, s_build = timed(lambda: make_host(spec), device)
    static = host.static  # None with --no-graphs (the plain transformers engine)
    if args.update != "best":
        _, _, args.minibatch = set_trainer(host, args.update)
    elif "update" not in sections:
        args.update = "full-bf16-16"
        _, _, args.minibatch = set_trainer(host, args.update)
    facts = model_facts(host)
    facts["vision_flops_per_patch"] = vision_flops_per_patch(host)
    facts["build_s"] = s_build
    facts["weights_gb"] = torch.cuda.memory_allocated() / 1e9 if device.type == "cuda" else 0
    RESULTS["model"] = facts
    log(f"model {args.shape}: {facts['params']['total'] / 1e9:.3f} B params, LoRA "
        f"{facts['lora_params'] / 1e6:.1f} M ({facts['lora_bytes'] / 1e6:.0f} MB), built in "
        f"{s_build:.1f} s, {facts['weights_gb']:.1f} GB on the device; decode reads "
        f"{facts['decode_weight_bytes'] / 1e9:.2f} GB of weights + "
        f"{facts['kv_bytes_per_token'] / 1e3:.0f} KB KV a token; graphs {static.use_graphs}")
    save(out)
    bw, peak = ceil["copy_bytes_per_s"], ceil["bf16_matmul_flops"]
    if "decode" in sections:
        section_decode(host, args, device, facts, bw)
        save(out)
    session = Session(host)
    try:
        if "update" in sections:
            section_update(session, args, device, facts, peak)
            save(out)
        if "step" in sections:
            section_step(session, args, device, facts, peak)
            save(out)
        if "turns" in sections:
            section_turns(session, args, device, facts, peak)
            save(out)
        if "scale" in sections:
            section_scale(session, args, device, facts, peak, args.deadline)
            save(out)
    finally:
        session.close()
    RESULTS["total_s"] = time.perf_counter() - T0
    save(out)
    summary(RESULTS)


def summary(res: dict) -> None:
    """The short table printed last."""
    c = res["ceilings"]
    print("\n=== summary ===")
    print(f"ceilings: copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    for k, r in res.get("decode", {}).items():
        if not k.startswith("graphs"):
            print(f"decode {k:16s} {r['decode_tokens_per_s']:10,.0f} tok/s "
                  f"{r['decode_ms_per_step']:7.2f} ms/step {r['pct_of_bandwidth_bound']:5.1f}% "
                  f"of bound; prefill {r['prefill_tokens_per_s']:10,.0f} tok/s")
    for k, r in res.get("update", {}).items():
        if isinstance(r, dict):
            print(f"update {k:14s} " + ("out of memory" if "oom" in r else
                  f"{r['tokens_per_s']:7,.0f} tok/s MFU {r['mfu_pct']:5.1f}% HFU "
                  f"{r['hfu_pct']:5.1f}% peak {r['peak_gb']:6.1f} GB"))
    if "step" in res:
        m = res["step"]["median"]
        print(f"GRPO step ({res['step']['decode_variant']} decode, {res['step']['update_variant']}"
              f" update) {m['P']}x{m['G']}: {m['step_s']:.1f} s (rollout {m['rollout_s']:.1f},"
              f" fwd_bwd {m['forward_backward_s']:.1f}, optim {m['optim_step_s']:.3f}, handoff "
              f"{m['handoff_s']:.3f}); update {m['update_tokens_per_s']:,.0f} tok/s MFU "
              f"{m['mfu_pct']:.1f}% HFU {m['hfu_pct']:.1f}%; peak sampler "
              f"{m['sampler_peak_gb']:.1f} GB trainer {m['trainer_peak_gb']:.1f} GB")
    for r in res.get("turns", []):
        print(f"turns {r['turns']:2d}: step {r['step_s']:6.1f} s rollout {r['rollout_s']:6.1f} "
              f"(captures {r['graph_capture_s_in_rollout']:.1f}) update {r['update_s']:6.1f} "
              f"tokens/episode {r['episode_tokens_mean']:.0f}")
    for r in res.get("scale", []):
        if "skipped" in r:
            print(f"scale size {r['size']} G {r['G']}: skipped")
            continue
        print(f"scale size {r['size']:2d} G {r['G']:2d}: step {r['step_s']:6.1f} s rollout "
              f"{r['rollout_s']:6.1f} update {r['update_s']:6.1f} MFU {r['mfu_pct']:4.1f}% peak "
              f"sampler {r['sampler_peak_gb']:5.1f} trainer {r['trainer_peak_gb']:5.1f} GB")
    print(f"total {res.get('total_s', float('nan')):.0f} s")


if __name__ == "__main__":
    main()
