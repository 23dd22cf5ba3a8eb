"""TRL's GRPOTrainer, vLLM colocated, on the workbench's multi-turn maze at the 8B shape, one GPU.

The task and settings of `python -m benchmarks.gpu` (the workbench's own step): 8 easy 9x9 mazes
(225 px, 64 image tokens) x G=8 samples = 64 episodes a step, up to 15 turns with a new maze image
each, temperature 1, LoRA r32 / alpha 64 on q,k,v,o,gate,up,down of the language model, bf16,
random weights of `qwen3-vl-8b-shape` (saved once under --workdir, as benchmarks/gpu.py does),
no gradient checkpointing, vLLM in the trainer's process at gpu_memory_utilization 0.3. TRL:

- TRL 1.16.0's multi-turn path, `GRPOTrainer(environment_factory=...)`, with the environment,
  prompts and templates of benchmarks/trl_multiturn.py (`maze_tools`: each move a tool that steps
  the workbench's MazeEnv and answers with the next image and user text; `KEYWORD_TEMPLATE`: a
  reply that is a move word is a tool call; `TOOL_CHAT_TEMPLATE`), `use_vllm=True,
  vllm_mode="colocate"`, `max_tool_calling_iterations=14`: 15 replies and 15 images an episode.
  TRL hands vLLM each turn's images (the prompt's and every tool answer's) with the token ids.
- Replies are constrained. A random model's free replies never parse as a tool call, so TRL would
  end every episode after one turn. `vllm_structured_outputs_regex="(up|down|left|right)"` makes
  every reply a move (no `stop`; a move into a wall leaves the agent in place), so episodes play
  all 15 turns. A reply is the word then <|im_end|>: 2-6 sampled tokens (each word is one token
  of this tokenizer, and xgrammar also admits spelling it in pieces: "l" "eft"), where the
  workbench samples 8 tokens a reply. The prompts are the keyword grammar's (trl_multiturn's);
  the workbench's benchmark runs the seed's tuple grammar, whose text is longer. So a TRL episode
  is ~1,750 tokens against the workbench's 2,514 (both 15 x 64 image tokens): compare per token
  (the JSON gives sampled and total tokens a step).
- One step = one generation of 64 completions and one optimizer step:
  `per_device_train_batch_size=--micro-batch` (1) and `gradient_accumulation_steps=64 /
  micro-batch`, so `steps_per_generation` (= gradient_accumulation_steps) x micro-batch = 64 =
  `generation_batch_size`; `num_generations=8`, `num_iterations=1`. 1 episode a forward/backward
  call: without checkpointing the workbench's own update took 98.5 GB at 2 of its episodes a call
  and no vLLM beside it (benchmarks/RESULTS.md), and peft's float32 LoRA path (TRL's) takes more.
- Loss: `loss_type="grpo"` (TRL's default is "dapo"; "grpo" is the workbench's reduction: token
  mean per sequence, then the mean over sequences), PPO clip 0.2, beta=0 (no reference model),
  group-scaled advantages; TRL's default vLLM importance-sampling correction stays on (a forward
  without grad over the 64 episodes a step; `--no-is-correction` drops it). AdamW (0.9, 0.95),
  grad-norm clip 1.0. A random model earns reward 0 everywhere, so advantages are 0; TRL keeps
  such rows and still runs the whole forward/backward.
- One patch of TRL (`one_pad_per_image`; `--stock-vllm-prompts` runs without it): TRL 1.16.0
  hands vLLM the processor's token ids, each image's <|image_pad|> already expanded to its 64
  tokens, and vLLM's Qwen3-VL processor expands pads again: the first pad of a prompt becomes 64
  more, and every further image of the prompt is matched inside that same run (huggingface/trl#6294;
  fixes open as PRs #6718 and #6719, tool images included). The patch cuts each run to one pad
  before `VLLMGeneration.generate`, as those PRs and the workbench's own engine do, so vLLM sees
  the episode the trainer trains on. TRL's training forward is untouched.
- vLLM's torch.distributed variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) are set
  by TRL itself before it starts vLLM (`VLLMGeneration._init_vllm`); the script sets none, so
  accelerate stays a plain one-process run (LOCAL_RANK set beforehand would make it 1-rank DDP).

    python -m benchmarks.trl_gpu --workdir /tmp/gb --out $OUT/trl.json --steps 3      # one H200
    benchmarks/.trl-venv/bin/python -m benchmarks.trl_gpu --smoke                      # the CPU

The GPU machine gets vLLM from shared/gpu/gpu_site.tar.xz and TRL from
benchmarks/trl_gpu_bundle.sh. --smoke runs the same code on `qwen3-vl-small-shape` in float32 on
the CPU with TRL's transformers generation (use_vllm=False), 2 steps of 2 mazes x 2 samples x 3
turns; there a `sequence_bias` stands in for vLLM's regex (a move word +100, <|im_end|> after a
move word +200): every reply is a move word then <|im_end|>.

Printed and written to --out after every step (a run cut short keeps its steps; a step that would
end past --deadline-s from the start is not begun): median step seconds (the first --skip steps
left out), sampled (completion) tokens/s, total tokens a step (prompt + completion with tool
answers, images expanded, all episodes), episodes a step, turns (replies) an episode, peak GPU
memory (this process: trainer and vLLM), rollout seconds; the command line and date.

Answers: How does the workbench's step compare with TRL's, vLLM colocated, on one GPU? Figures:
benchmarks/RESULTS.md, "The H200 against TRL".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.trl_compare import RunRecord, lora_settings, timed_phase
from benchmarks.trl_multiturn import MultiConfig, maze_tools, run_config, tool_processor, trl_rows

MOVES = ("up", "down", "left", "right")
MOVES_REGEX = "(" + "|".join(MOVES) + ")"
GIB = 2**30


@dataclass(frozen=True)
class TrlGpuConfig:
    """One run's settings (defaults: the GPU run)."""

    shape: str = "qwen3-vl-8b-shape"  # workbench.model.presets shape, random weights
    device: str = "cuda"
    use_vllm: bool = True  # vLLM colocated (False: TRL's transformers generation)
    steps: int = 3  # optimizer steps run (one generation each)
    skip: int = 1  # first steps left out of the medians
    prompts: int = 8  # P: mazes a step
    group: int = 8  # G: samples a maze (num_generations)
    turns: int = 15  # replies an episode (max_tool_calling_iterations = turns - 1)
    micro_batch: int = 1  # episodes a forward/backward call (per_device_train_batch_size)
    gradient_checkpointing: bool = False
    is_correction: bool = True  # TRL's vllm_importance_sampling_correction (its default)
    stock_vllm_prompts: bool = False  # True: TRL 1.16's expanded image pads to vLLM, unpatched
    gpu_memory_utilization: float = 0.3  # vLLM's share of the GPU (the workbench's)
    max_model_len: int = 8192  # vLLM context; an episode is ~1,750 tokens
    max_completion_length: int = 6144  # TRL: all replies and tool answers of an episode
    temperature: float = 1.0
    learning_rate: float = 1e-5
    lora_rank: int = 32
    lora_alpha: int = 64
    maze_size: int = 9
    px_per_cell: int = 25  # the seed_gpu preset's: a 225 px image, 64 image tokens
    deadline_s: float = 540.0  # stop before a step that would end past this (from start)

    @property
    def episodes(self) -> int:
        return self.prompts * self.group


SMOKE = dict(shape="qwen3-vl-small-shape", device="cpu", use_vllm=False, steps=2, prompts=2,
             group=2, turns=3, micro_batch=2, max_completion_length=2048, deadline_s=3600.0)
TUNABLE = ("steps", "skip", "prompts", "group", "turns", "micro_batch", "max_model_len",
           "max_completion_length", "gpu_memory_utilization", "deadline_s")


def move_bias(tokenizer: Any) -> list[list[Any]]:
    """transformers' `sequence_bias` that makes every reply a move word then <|im_end|> (the
    smoke's stand-in for vLLM's regex; each move word is one token of this tokenizer)."""
    words = [tokenizer.encode(w, add_special_tokens=False) for w in MOVES]
    if any(len(ids) != 1 for ids in words):
        raise ValueError(f"move words are not single tokens: {dict(zip(MOVES, words))}")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return [[ids, 100.0] for ids in words] + [[ids + [eos], 200.0] for ids in words]


def trl_args(cfg: TrlGpuConfig, out_dir: str, tokenizer: Any) -> Any:
    """GRPOConfig: one generation of P x G episodes and one optimizer step a step."""
    from trl import GRPOConfig

    if cfg.episodes % cfg.micro_batch:
        raise ValueError(f"--micro-batch {cfg.micro_batch} must divide {cfg.episodes} episodes")
    cuda = cfg.device == "cuda"
    return GRPOConfig(
        output_dir=out_dir, max_steps=cfg.steps, seed=0,
        per_device_train_batch_size=cfg.micro_batch,
        gradient_accumulation_steps=cfg.episodes // cfg.micro_batch,
        num_generations=cfg.group, num_iterations=1,
        max_completion_length=cfg.max_completion_length,
        max_tool_calling_iterations=cfg.turns - 1,
        temperature=cfg.temperature, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2,
        loss_type="grpo", scale_rewards="group", learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        bf16=cuda, use_cpu=not cuda, gradient_checkpointing=cfg.gradient_checkpointing,
        use_vllm=cfg.use_vllm, vllm_mode="colocate",
        vllm_gpu_memory_utilization=cfg.gpu_memory_utilization,
        vllm_max_model_length=cfg.max_model_len,
        vllm_structured_outputs_regex=MOVES_REGEX if cfg.use_vllm else None,
        vllm_importance_sampling_correction=cfg.is_correction,
        generation_kwargs=None if cfg.use_vllm else {"sequence_bias": move_bias(tokenizer)},
        shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        remove_unused_columns=False,
    )


def one_pad_per_image(ids_T: list[int], pad: int) -> list[int]:
    """`ids_T` with each run of `pad` cut to one pad (vLLM expands a pad to its image's tokens)."""
    return [t for i, t in enumerate(ids_T) if t != pad or i == 0 or ids_T[i - 1] != pad]


def load_policy(cfg: TrlGpuConfig, workdir: Path) -> tuple[Any, float]:
    """The shape's random model (saved under workdir/model once, for vLLM) with LoRA; seconds."""
    from transformers import AutoModelForImageTextToText

    from workbench.model import add_lora
    from workbench.model.presets import save_random

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if cfg.device == "cuda" else torch.float32
    folder = save_random(cfg.shape, workdir / "model", dtype, cfg.device)
    model = AutoModelForImageTextToText.from_pretrained(
        folder, dtype=dtype, attn_implementation="sdpa",
        device_map={"": cfg.device} if cfg.device == "cuda" else None)
    model.name_or_path = folder  # vLLM (colocate) loads this folder
    return add_lora(model, lora_settings(cfg)), time.perf_counter() - t0


def gpu_memory() -> dict[str, float]:
    """This process's peak allocated / reserved GiB since the last reset, and the device's use."""
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
            "device_used_gib": (total - free) / GIB}


def instrument(trainer: Any, rec: RunRecord, cfg: TrlGpuConfig) -> None:
    """Count a step's sampled tokens, total tokens, episodes and turns; time its rollout; and
    (unless cfg.stock_vllm_prompts) hand vLLM one pad per image."""
    sampled: list[int] = []
    generate_single = trainer._generate_single_turn

    def counted(*a: Any, **k: Any) -> Any:
        ids_B, logprobs = generate_single(*a, **k)
        sampled.append(sum(len(ids) for ids in ids_B))
        return ids_B, logprobs

    generate = timed_phase(rec, "rollout", trainer._generate)

    def rollout(prompts: list) -> Any:
        out = generate(prompts)
        prompt_ids_E, completion_ids_E, completions_E = out[0], out[1], out[3]
        turns_E = [sum(m.get("role") == "assistant" for m in c) for c in completions_E]
        rec.completion_tokens.append(sum(sampled))
        rec.total_tokens.append(sum(len(p) + len(c) for p, c in zip(prompt_ids_E,
                                                                     completion_ids_E)))
        rec.trained_rows.append(len(completions_E))
        rec.add_phase("turns_mean", statistics.mean(turns_E))
        rec.add_phase("turns_min", min(turns_E))
        sampled.clear()
        return out

    trainer._generate_single_turn = counted
    trainer._generate = rollout
    if cfg.use_vllm and not cfg.stock_vllm_prompts:
        vllm_generate = trainer.vllm_generation.generate
        pad = trainer.processing_class.image_token_id

        def unexpanded(prompts: list, images: Any, num_generations: int,
                       profiler: Any = None) -> Any:
            return vllm_generate(prompts=[one_pad_per_image(p, pad) for p in prompts],
                                 images=images, num_generations=num_generations,
                                 profiler=profiler)

        trainer.vllm_generation.generate = unexpanded


def step_timer(rec: RunRecord, cfg: TrlGpuConfig, started: float, report: Any) -> Any:
    """A TrainerCallback: a step runs from on_step_begin to on_step_end (synchronized); each end
    prints the step, writes the report, and stops training before a step past the deadline."""
    from transformers import TrainerCallback

    marks: dict[str, float] = {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            marks["begin"] = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            rec.step_s.append(time.perf_counter() - marks["begin"])
            for key, value in gpu_memory().items():
                rec.add_phase(key, value)
            k = len(rec.step_s)
            print(f"step {k}: {rec.step_s[-1]:.2f} s (rollout {rec.phases_s['rollout'][-1]:.2f}"
                  f" s), {rec.completion_tokens[-1]} sampled tokens, {rec.total_tokens[-1]} "
                  f"tokens, {rec.trained_rows[-1]} episodes, "
                  f"{rec.phases_s['turns_mean'][-1]:.2f} turns"
                  + (f", peak {rec.phases_s['peak_allocated_gib'][-1]:.1f} GiB"
                     if torch.cuda.is_available() else ""), flush=True)
            report()
            if time.perf_counter() - started + rec.step_s[-1] > cfg.deadline_s:
                print(f"stopping: another step would end past {cfg.deadline_s:.0f} s", flush=True)
                control.should_training_stop = True

    return StepTimer()


def summarize(rec: RunRecord, cfg: TrlGpuConfig) -> dict[str, Any]:
    """Medians and rates over the steps after the first cfg.skip (all steps if no more)."""
    skip = cfg.skip if len(rec.step_s) > cfg.skip else 0
    step_s = rec.step_s[skip:]
    out: dict[str, Any] = {"steps_timed": len(step_s)}
    if not step_s:
        return out
    phases = rec.phases_s
    out |= {
        "median_step_s": statistics.median(step_s),
        "median_rollout_s": statistics.median(phases["rollout"][skip:]),
        "sampled_tokens_per_s": sum(rec.completion_tokens[skip:]) / sum(step_s),
        "total_tokens_per_s": sum(rec.total_tokens[skip:]) / sum(step_s),
        "sampled_tokens_per_step": statistics.mean(rec.completion_tokens[skip:]),
        "total_tokens_per_step": statistics.mean(rec.total_tokens[skip:]),
        "episodes_per_step": statistics.mean(rec.trained_rows[skip:]),
        "turns_per_episode": statistics.mean(phases["turns_mean"][skip:]),
        "turns_min": min(phases["turns_min"][skip:]),
    }
    if "peak_allocated_gib" in phases:
        out |= {key: max(phases[key]) for key in
                ("peak_allocated_gib", "peak_reserved_gib", "device_used_gib")}
    return out


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "pyarrow",
                 "vllm", "xgrammar"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def run(cfg: TrlGpuConfig, workdir: Path, out: Path, argv: list[str],
        started: float) -> dict[str, Any]:
    """Load, build the trainer (vLLM starts here), train cfg.steps steps; the report. `started`:
    the perf_counter the deadline counts from."""
    from datasets import Dataset
    from trl import GRPOTrainer

    from workbench.config import apply_overrides

    rec = RunRecord("trl", 0, threads=torch.get_num_threads())
    model, load_s = load_policy(cfg, workdir)
    processor = tool_processor(model.name_or_path)
    multi = MultiConfig(model=model.name_or_path, steps=cfg.steps, prompts=cfg.prompts,
                        group=cfg.group, turns=cfg.turns, temperature=cfg.temperature,
                        maze_size=cfg.maze_size)
    config = apply_overrides(run_config(multi, str(workdir / "run"), 0),  # the maze task
                             [f"env.px_per_cell={cfg.px_per_cell}"])
    t0 = time.perf_counter()
    args = trl_args(cfg, str(workdir / "trl"), processor.tokenizer)
    trainer = GRPOTrainer(model=model, args=args, processing_class=processor,
                          train_dataset=Dataset.from_list(trl_rows(config)),
                          environment_factory=maze_tools(config))
    init_s = time.perf_counter() - t0
    instrument(trainer, rec, cfg)
    report: dict[str, Any] = {}

    def write() -> None:
        report.update(summarize(rec, cfg))
        report["steps"] = asdict(rec)
        report["setup"] = {
            "config": asdict(cfg), "command": " ".join(["python -m benchmarks.trl_gpu", *argv]),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": (torch.cuda.get_device_name() if cfg.device == "cuda" else
                        f"{platform.machine()}, {os.cpu_count()} cores, no GPU"),
            "versions": versions(), "model_load_s": load_s, "trainer_init_s": init_s,
            "seconds": time.perf_counter() - started,
            "generation_batch_size": trainer.args.generation_batch_size,
            "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
            "vllm_prompts": "expanded (TRL 1.16 stock)" if cfg.stock_vllm_prompts or
                            not cfg.use_vllm else "one pad per image (patched)"}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))

    trainer.add_callback(step_timer(rec, cfg, started, write))
    print(f"model {load_s:.1f} s, trainer (vLLM start) {init_s:.1f} s; "
          f"{trainer.args.generation_batch_size} episodes a generation, "
          f"{trainer.args.gradient_accumulation_steps} micro-batches of {cfg.micro_batch}",
          flush=True)
    trainer.train()
    write()
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, no vLLM, 2 steps")
    ap.add_argument("--workdir", default="", help="model folder and TRL output (default: a temp)")
    ap.add_argument("--out", default="runs/bench/trl_gpu.json")
    for name in TUNABLE:
        default = getattr(TrlGpuConfig, name)
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=None,
                        help=f"default {default} ({SMOKE.get(name, default)} with --smoke)")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing on")
    ap.add_argument("--no-is-correction", action="store_true",
                    help="vllm_importance_sampling_correction=False")
    ap.add_argument("--stock-vllm-prompts", action="store_true",
                    help="hand vLLM TRL 1.16's expanded image pads, unpatched "
                         "(huggingface/trl#6294)")
    args = ap.parse_args(argv)
    cfg = TrlGpuConfig(**SMOKE) if args.smoke else TrlGpuConfig()
    given = {k: getattr(args, k) for k in TUNABLE if getattr(args, k) is not None}
    cfg = replace(cfg, **given, gradient_checkpointing=args.grad_ckpt,
                  is_correction=not args.no_is_correction,
                  stock_vllm_prompts=args.stock_vllm_prompts)
    if cfg.device == "cpu":
        torch.set_num_threads(1)  # a shared 2-core machine
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory's warning
    if args.workdir:
        res = run(cfg, Path(args.workdir), Path(args.out), argv, started)
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="trl-gpu-") as tmp:
            res = run(cfg, Path(tmp), Path(args.out), argv, started)
    print(json.dumps({k: v for k, v in res.items() if k not in ("steps", "setup")}, indent=1))
    return res


if __name__ == "__main__":
    main()
