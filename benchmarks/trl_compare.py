"""Workbench vs TRL's GRPOTrainer on the same single-turn maze GRPO: throughput and reward curves.

The task: one prompt = the system rules + one 7x7 maze image (as the workbench renders it, with
the first-turn budget text) of a random open square in a random training maze; the model replies
with one move. Reward 1.0 when the reply parses to a move onto a shortest path to the goal
(`move_reward`, by BFS), else 0.0. Both trainers get the same prompts in the same order (a
seeded pool of `pool` prompts, cycled, so a pass over the pool is a comparable point of the
learning curve), start from the same weights (a model folder, LoRA A matrices from the same
seed), and run the same GRPO: P prompts x G samples a step, temperature 1.0, replies of at
most `max_tokens` tokens, group-normalised advantages, PPO-clip surrogate (0.2) averaged per
sequence then over sequences, no KL (beta 0), one AdamW step per batch (betas 0.9/0.95, no
weight decay, grad-norm clip 1.0, constant lr), LoRA on the language model's projections.

- workbench: `create_session` -> per step: the P prompt streams, `SamplingClient.sample` (one call
  a prompt, G replies from one prefill), `phases.advantages`, datums for the groups that carry
  signal, `forward_backward("ppo")`, `optim_step`.
- TRL: `GRPOTrainer` with the same model object (peft-wrapped), the folder's processor, a
  `datasets.Dataset` of conversational prompts + an "image" column, and the same reward
  function through TRL's protocol `reward(completions, **columns) -> list[float]`.

One run alternates them: workbench run, TRL run, workbench run, ... (`--rounds` of each; round r
samples with seed r on both sides), both at `--threads` torch threads (default 1: on a shared
2-core machine, 2 OpenMP threads stall whenever another job takes a core). Printed and written to
runs/bench/trl_compare.json: median seconds a step (the first step of each run left out),
steps/s, sampled (completion) tokens/s, all tokens/s (P x G x prompt + completion tokens: the
task's work, the same count for both), the workbench/TRL ratio, per-phase seconds, the reward per
step of each run and per pass over the pool. See benchmarks/RESULTS.md for the figures.

    bash benchmarks/trl_env.sh                      # TRL's venv, once (benchmarks/.trl-venv)
    benchmarks/.trl-venv/bin/python -m benchmarks.trl_compare --plot docs/trl_compare.png
    benchmarks/.trl-venv/bin/python -m benchmarks.trl_compare --smoke   # 2 steps each, 1 round

The start model defaults to runs/bench/trl_sft/model, built on first use by the workbench's SFT
(`python -m workbench sft run_dir=runs/bench/trl_sft`, 480 steps, ~4 min; not timed here).

Answers: How does the workbench's single-turn GRPO compare with TRL's on the CPU? Figures:
benchmarks/RESULTS.md, "CPU against TRL".
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.envs import InitState, MazeConfig, MazeEnv, make_maze, parse_action, system_prompt
from workbench.envs.env import FIRST_TRAIN_SEED
from workbench.envs.maze import shortest_path, step_pos
from workbench.model import LoraSettings, add_lora
from workbench.rl.rollout import user_text

PROMPT_SEED_OFFSET = 70_000_000  # prompt mazes: training seeds clear of SFT's and GRPO's
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class CompareConfig:
    """The shared GRPO settings of both trainers."""

    model: str = "runs/bench/trl_sft/model"  # start model folder (built by SFT if missing)
    sft_steps: int = 480  # SFT steps when the start model has to be built
    steps: int = 48  # optimiser steps per run
    pool: int = 48  # distinct prompts, cycled in order (steps * prompts / pool epochs)
    rounds: int = 2  # runs of each trainer, alternating (workbench, TRL, workbench, ...)
    prompts: int = 4  # P: prompts per step
    group: int = 8  # G: samples per prompt
    max_tokens: int = 4  # reply length cap
    temperature: float = 1.0  # sampling temperature (trainer log-probs at the same temperature)
    learning_rate: float = 3e-4  # constant AdamW learning rate
    lora_rank: int = 32  # LoRA r on q,k,v,o,gate,up,down of the language model
    lora_alpha: int = 64  # LoRA alpha
    threads: int = 1  # torch.set_num_threads, the same for both (1: robust on a shared machine)
    seed: int = 0  # prompt-set seed (sampling seeds are the round numbers)
    maze_size: int = 7  # maze side incl. the outer wall


@dataclass(frozen=True)
class MovePrompt:
    """One single-turn task: a maze, the agent's square, and what the model is shown."""

    maze_seed: int
    pos: tuple[int, int]
    image_HW3: np.ndarray  # the workbench's rendering (32 px a square)
    text: str  # the user text after the image (first-turn budget line)


@dataclass
class RunRecord:
    """One trainer's run: per-step seconds, phase seconds, tokens and mean rewards."""

    trainer: str
    round: int
    step_s: list[float] = field(default_factory=list)
    phases_s: dict[str, list[float]] = field(default_factory=dict)
    completion_tokens: list[int] = field(default_factory=list)
    total_tokens: list[int] = field(default_factory=list)  # prompt + completion, all P x G rows
    reward_mean: list[float] = field(default_factory=list)
    trained_rows: list[int] = field(default_factory=list)  # sequences in the loss
    threads: int = 0

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases_s.setdefault(name, []).append(seconds)


def sample_prompts(config: MazeConfig, n: int, seed: int) -> list[MovePrompt]:
    """n prompts: maze k is training seed PROMPT_SEED_OFFSET + seed * 1e6 + k, the square a
    uniform open square other than the goal."""
    rng = np.random.default_rng(seed)
    prompts = []
    for k in range(n):
        maze_seed = FIRST_TRAIN_SEED + PROMPT_SEED_OFFSET + seed * 1_000_000 + k
        maze = make_maze(config.size, maze_seed)
        open_cells = [(int(r), int(c)) for r, c in np.argwhere(~maze.walls_HW)
                      if (r, c) != maze.goal]
        pos = open_cells[int(rng.integers(len(open_cells)))]
        env = MazeEnv(config)
        state = InitState(maze_seed=maze_seed, size=config.size, start=pos, goal=maze.goal)
        obs, info = env.reset(options={"init_state": state})
        prompts.append(MovePrompt(maze_seed, pos, obs["image"], user_text(obs, info, config)))
    return prompts


def move_reward(reply: str, maze_seed: int, pos: tuple[int, int], config: MazeConfig) -> float:
    """1.0 if the reply parses to a move that shortens the BFS distance to the goal by one."""
    action = parse_action(reply, config.grammar)
    if action.kind != "move":
        return 0.0
    maze = make_maze(config.size, maze_seed)
    after = step_pos(maze, pos, action.direction)
    if after == pos:
        return 0.0  # a wall
    return float(len(shortest_path(maze, after, maze.goal))
                 == len(shortest_path(maze, pos, maze.goal)) - 1)


def lora_settings(cfg: CompareConfig) -> LoraSettings:
    return LoraSettings(rank=cfg.lora_rank, alpha=cfg.lora_alpha)


def run_workbench(cfg: CompareConfig, maze: MazeConfig, prompts: list[MovePrompt],
                  round_: int) -> RunRecord:
    """`cfg.steps` GRPO steps through the workbench's session API (in-process)."""
    from workbench.policy import (
        SamplingParams,
        append_reply,
        append_user,
        chat_format,
        encode_image,
        start_stream,
    )
    from workbench.rl import phases
    from workbench.session import (
        AdamParams,
        LossConfig,
        SessionSpec,
        create_session,
        datum_from_stream,
    )

    rec = RunRecord("workbench", round_, threads=torch.get_num_threads())
    with tempfile.TemporaryDirectory(prefix="trl-compare-wb-") as workdir:
        session = create_session(SessionSpec(cfg.model, lora_settings(cfg), workdir=workdir))
        tc = session.training_client
        processor, P, G = tc.get_processor(), cfg.prompts, cfg.group
        fmt, tok = chat_format(processor), processor.tokenizer
        system = start_stream(processor, fmt, system_prompt(maze))
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature)
        adam = AdamParams(learning_rate=cfg.learning_rate, beta1=0.9, beta2=0.95,
                          weight_decay=0.0, grad_clip_norm=1.0)
        summed = LossConfig(reduction="sum", temperature=cfg.temperature)
        for step in range(cfg.steps):
            batch = prompts[step * P:(step + 1) * P]
            t0 = time.perf_counter()
            streams_P = [append_user(system, processor, fmt, p.text,
                                     encode_image(processor, p.image_HW3)) for p in batch]
            t1 = time.perf_counter()
            sampler = tc.save_weights_and_get_sampling_client()
            futures = [sampler.sample(s, G, params, seed=1_000_003 * round_ + step * P + p)
                       for p, s in enumerate(streams_P)]
            groups_P_G = [f.result().sequences for f in futures]
            t2 = time.perf_counter()
            rewards_P_G = np.array([[move_reward(tok.decode(c.tokens, skip_special_tokens=True),
                                                 p.maze_seed, p.pos, maze) for c in group]
                                    for p, group in zip(batch, groups_P_G)])
            adv = phases.advantages(rewards_P_G, "grpo")
            datums = [datum_from_stream(append_reply(s, fmt, c.tokens, c.logprobs), float(a))
                      for s, group, adv_G in zip(streams_P, groups_P_G, adv.advantages_P_G)
                      for c, a in zip(group, adv_G) if a != 0.0]
            t3 = time.perf_counter()
            if datums:  # as phases.update: the batch's sequence mean folded into the weights
                datums = phases.global_weights(datums, "sequence_mean")
                tc.forward_backward(datums, "ppo", summed).result()
                t4 = time.perf_counter()
                tc.optim_step(adam).result()
            else:
                t4 = time.perf_counter()
            t5 = time.perf_counter()
            for name, sec in (("prompts", t1 - t0), ("generate", t2 - t1), ("reward", t3 - t2),
                              ("forward_backward", t4 - t3), ("optimizer", t5 - t4)):
                rec.add_phase(name, sec)
            rec.step_s.append(t5 - t0)
            rec.reward_mean.append(float(rewards_P_G.mean()))
            rec.trained_rows.append(len(datums))
            rec.completion_tokens.append(sum(len(c.tokens) for g in groups_P_G for c in g))
            rec.total_tokens.append(sum(len(s) * G for s in streams_P) + rec.completion_tokens[-1])
        session.close()
    return rec


def _trl_rows(maze: MazeConfig, prompts: list[MovePrompt]) -> list[dict[str, Any]]:
    """TRL's dataset rows: a conversational prompt, its image and the reward's columns."""
    from PIL import Image

    return [{"prompt": [{"role": "system", "content": system_prompt(maze)},
                        {"role": "user", "content": p.text}],
             "image": Image.fromarray(p.image_HW3), "maze_seed": p.maze_seed,
             "row": p.pos[0], "col": p.pos[1]} for p in prompts]


def trl_config(cfg: CompareConfig, out_dir: str, round_: int, banned: list[int]) -> Any:
    """GRPOConfig matched to the workbench's step (see the module docstring)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir, max_steps=cfg.steps, seed=round_,
        per_device_train_batch_size=cfg.prompts * cfg.group, gradient_accumulation_steps=1,
        num_generations=cfg.group, num_iterations=1, max_completion_length=cfg.max_tokens,
        temperature=cfg.temperature, top_p=1.0, top_k=0, beta=0.0, epsilon=0.2,
        loss_type="grpo", scale_rewards="group", learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        generation_kwargs={"suppress_tokens": banned}, shuffle_dataset=False,
        bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False,
        logging_steps=cfg.steps, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False, remove_unused_columns=False,
    )


def timed_phase(rec: RunRecord, name: str, fn: Any) -> Any:
    """Wrap a bound method so each call adds its seconds to rec's phase `name`."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.add_phase(name, time.perf_counter() - t0)
    return wrapper


def step_timer(callback_base: type, rec: RunRecord) -> Any:
    """A TRL callback (`callback_base`: transformers' TrainerCallback, which imports only in
    TRL's venv) that times step k from on_step_begin k to on_step_begin k+1 (train end for the
    last) into rec.step_s, and the optimiser step into rec's phase "optimizer"."""
    marks: dict[str, float] = {}

    class StepTimer(callback_base):  # type: ignore[misc, valid-type]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.perf_counter()
            if "begin" in marks:
                rec.step_s.append(now - marks["begin"])
            marks["begin"] = now

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            marks["pre_opt"] = time.perf_counter()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            rec.add_phase("optimizer", time.perf_counter() - marks["pre_opt"])

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            rec.step_s.append(time.perf_counter() - marks["begin"])

    return StepTimer()


def run_trl(cfg: CompareConfig, maze: MazeConfig, prompts: list[MovePrompt],
            round_: int) -> RunRecord:
    """`cfg.steps` GRPO steps through TRL's GRPOTrainer on the same model folder."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOTrainer

    from workbench.policy import chat_format

    rec = RunRecord("trl", round_, threads=torch.get_num_threads())
    processor = AutoProcessor.from_pretrained(cfg.model)
    model = AutoModelForImageTextToText.from_pretrained(cfg.model, dtype=torch.float32,
                                                        attn_implementation="sdpa")
    model = add_lora(model, lora_settings(cfg))  # the workbench's LoRA, the same A init

    def move_reward_trl(completions: list, completion_ids: list, maze_seed: list, row: list,
                        col: list, **_: Any) -> list[float]:
        replies = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        rewards = [move_reward(r, s, (y, x), maze)
                   for r, s, y, x in zip(replies, maze_seed, row, col)]
        rec.reward_mean.append(float(np.mean(rewards)))
        rec.completion_tokens.append(sum(len(ids) for ids in completion_ids))
        rec.trained_rows.append(len(rewards))  # TRL keeps zero-advantage rows in the loss
        return rewards

    banned = list(chat_format(processor).banned)
    with tempfile.TemporaryDirectory(prefix="trl-compare-trl-") as out_dir:
        trainer = GRPOTrainer(model=model, reward_funcs=move_reward_trl,
                              args=trl_config(cfg, out_dir, round_, banned),
                              train_dataset=Dataset.from_list(_trl_rows(maze, prompts)),
                              processing_class=processor,
                              callbacks=[step_timer(TrainerCallback, rec)])
        for attr, name in (("_generate", "generate"), ("_calculate_rewards", "reward"),
                           ("_prepare_inputs", "prepare"), ("compute_loss", "loss_forward"),
                           ("training_step", "training_step")):
            setattr(trainer, attr, timed_phase(rec, name, getattr(trainer, attr)))
        torch.set_num_threads(cfg.threads)  # as the workbench run; accelerate may not touch it
        trainer.train()
    _trl_phases(rec)
    del trainer, model
    return rec


def _trl_phases(rec: RunRecord) -> None:
    """Nested timings -> disjoint phases: prepare = generate + reward + prepare_other;
    training_step = prepare + loss_forward + backward (Trainer.training_step's other work)."""
    ph = rec.phases_s
    prepare, step = ph.pop("prepare"), ph.pop("training_step")
    ph["prepare_other"] = [p - g - r for p, g, r in zip(prepare, ph["generate"], ph["reward"])]
    ph["backward"] = [t - p - f for t, p, f in zip(step, prepare, ph["loss_forward"])]
    ph["forward_backward"] = [f + b for f, b in zip(ph["loss_forward"], ph["backward"])]


def check_same_prompt(cfg: CompareConfig, maze: MazeConfig, prompt: MovePrompt) -> int:
    """TRL's rendering of a prompt (prepare_multimodal_messages + the processor's chat template)
    must give the workbench stream's exact tokens; returns the prompt length."""
    from transformers import AutoProcessor
    from trl.data_utils import prepare_multimodal_messages

    from workbench.policy import append_user, chat_format, encode_image, start_stream

    processor = AutoProcessor.from_pretrained(cfg.model)
    fmt = chat_format(processor)
    stream = append_user(start_stream(processor, fmt, system_prompt(maze)), processor, fmt,
                         prompt.text, encode_image(processor, prompt.image_HW3))
    row = _trl_rows(maze, [prompt])[0]
    messages = prepare_multimodal_messages(row["prompt"], images=[row["image"]])
    ids = processor.apply_chat_template([messages], add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"][0]
    if list(ids) != stream.tokens_T:
        raise AssertionError(f"TRL's prompt tokens differ from the workbench's:\n{list(ids)}\n"
                             f"{stream.tokens_T}")
    return len(stream)


def ensure_model(cfg: CompareConfig) -> None:
    """Build the SFT start model with the workbench's CLI when the folder is missing."""
    folder = Path(cfg.model)
    if (folder / "config.json").exists():
        return
    if folder.name != "model":
        raise FileNotFoundError(f"{folder} does not exist (and is not an SFT run's model folder)")
    print(f"building the start model: python -m workbench sft sft.steps={cfg.sft_steps} "
          f"run_dir={folder.parent}", flush=True)
    subprocess.run([sys.executable, "-m", "workbench", "sft", f"sft.steps={cfg.sft_steps}",
                    f"run_dir={folder.parent}"], check=True)


def summarize(runs: list[RunRecord], cfg: CompareConfig, skip: int) -> dict[str, Any]:
    """Per trainer: median s/step (steps after the first `skip` of each run), steps/s, tokens/s,
    median phase seconds, reward curves; and the workbench / TRL throughput ratio."""
    out: dict[str, Any] = {}
    for name in ("workbench", "trl"):
        mine = [r for r in runs if r.trainer == name]
        step_s = [s for r in mine for s in r.step_s[skip:]]
        comp = [c for r in mine for c in r.completion_tokens[skip:]]
        total = [t for r in mine for t in r.total_tokens[skip:]]
        med = statistics.median(step_s)
        curves = [r.reward_mean for r in mine]
        per_epoch = max(1, cfg.pool // cfg.prompts)  # steps that see every pool prompt once
        epochs = [[float(np.mean(c[e:e + per_epoch])) for e in range(0, len(c), per_epoch)]
                  for c in curves]
        out[name] = {
            "median_step_s": med, "steps_per_s": 1.0 / med,
            "completion_tokens_per_s": sum(comp) / sum(step_s),
            "total_tokens_per_s": sum(total) / sum(step_s),
            "mean_step_s": statistics.mean(step_s),
            "mean_trained_rows": float(np.mean([n for r in mine for n in r.trained_rows])),
            "phases_median_s": {p: statistics.median(v for r in mine for v in r.phases_s[p][skip:])
                                for p in mine[0].phases_s},
            "reward_curves": curves,
            "reward_mean_curve": [float(np.mean(col)) for col in zip(*curves)],
            "reward_per_epoch": epochs,  # mean reward over the pool, each pass, each run
            "runs": [asdict(r) for r in mine],
        }
    wb, trl = out["workbench"], out["trl"]
    out["ratio_workbench_over_trl"] = {
        "steps_per_s": wb["steps_per_s"] / trl["steps_per_s"],
        "completion_tokens_per_s": wb["completion_tokens_per_s"] / trl["completion_tokens_per_s"],
    }
    return out


def print_summary(res: dict[str, Any], cfg: CompareConfig) -> None:
    P, G = cfg.prompts, cfg.group
    print(f"\nsingle-turn maze GRPO, {P} prompts x {G} samples, <= {cfg.max_tokens} tokens, "
          f"{cfg.steps} steps x {cfg.rounds} runs each, {cfg.threads} threads")
    print(f"{'':<10} {'s/step':>8} {'steps/s':>8} {'compl tok/s':>12} {'all tok/s':>10}  "
          f"phases (median s)")
    for name in ("workbench", "trl"):
        r = res[name]
        phases = "  ".join(f"{k} {v:.3f}" for k, v in r["phases_median_s"].items())
        print(f"{name:<10} {r['median_step_s']:8.3f} {r['steps_per_s']:8.2f} "
              f"{r['completion_tokens_per_s']:12.1f} {r['total_tokens_per_s']:10.0f}  {phases}")
    ratio = res["ratio_workbench_over_trl"]
    print(f"ratio workbench / TRL: steps/s {ratio['steps_per_s']:.2f}x, completion tokens/s "
          f"{ratio['completion_tokens_per_s']:.2f}x")
    print("\nmean reward per step (each run; mean of P x G rewards):")
    wb, trl = res["workbench"]["reward_curves"], res["trl"]["reward_curves"]
    print("step  " + "  ".join(f"wb{r}  " for r in range(len(wb)))
          + "  ".join(f"trl{r} " for r in range(len(trl))))
    for s in range(cfg.steps):
        print(f"{s + 1:>4}  " + "  ".join(f"{c[s]:.3f}" for c in wb) + "  "
              + "  ".join(f"{c[s]:.3f}" for c in trl))
    print(f"\nmean reward per pass over the {cfg.pool}-prompt pool (each run):")
    for name in ("workbench", "trl"):
        for r, ep in enumerate(res[name]["reward_per_epoch"]):
            print(f"  {name:<9} run {r}: " + "  ".join(f"{v:.3f}" for v in ep))


def plot(res: dict[str, Any], path: Path) -> None:
    """Reward curves (each run, thin; mean, thick) and the median step time of each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6), width_ratios=[2.2, 1])
    per_epoch = max(1, res["setup"]["config"]["pool"] // res["setup"]["config"]["prompts"])
    for name, colour in (("workbench", "tab:blue"), ("trl", "tab:orange")):
        for curve in res[name]["reward_curves"]:
            ax.plot(range(1, len(curve) + 1), curve, color=colour, alpha=0.25, lw=1)
        epochs = np.mean(res[name]["reward_per_epoch"], axis=0)
        mid = [per_epoch * (e + 0.5) + 0.5 for e in range(len(epochs))]
        ax.plot(mid, epochs, "o-", color=colour, lw=2, label=f"{name} (pass mean)")
    ax.set(xlabel="GRPO step", ylabel="mean reward (P x G)",
           title="reward per step (thin: each run) and per pass over the pool")
    ax.legend()
    names = ["workbench", "trl"]
    bx.bar(names, [res[n]["median_step_s"] for n in names], color=["tab:blue", "tab:orange"])
    bx.set(ylabel="median s / step", title=f"{res['ratio_workbench_over_trl']['steps_per_s']:.1f}x "
                                          "steps/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> tuple[CompareConfig, argparse.Namespace]:
    defaults = CompareConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in asdict(defaults).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    ap.add_argument("--smoke", action="store_true", help="2 steps each, 1 round (a quick check)")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps of each run left out of "
                    "the timing medians")
    ap.add_argument("--out", default="runs/bench/trl_compare.json")
    ap.add_argument("--plot", default="", help="PNG of the reward curves (e.g. docs/"
                    "trl_compare.png); empty for none")
    args = ap.parse_args(argv)
    cfg = CompareConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    if args.smoke:
        cfg = CompareConfig(**{**asdict(cfg), "steps": 2, "rounds": 1})
        args.skip = 0
    return cfg, args


def save_result(res: dict[str, Any], out: str, plot_to: str,
                plot_fn: Callable[[dict[str, Any], Path], None]) -> dict[str, Any]:
    """Write `res` as JSON to `out` (its folder made) and, when `plot_to` is set, its plot."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    if plot_to:
        plot_fn(res, Path(plot_to))
    return res


def load_average() -> list[float]:
    import os

    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import transformers
    import trl

    cfg, args = parse_args(argv)
    torch.set_num_threads(cfg.threads)
    ensure_model(cfg)
    maze = MazeConfig(size=cfg.maze_size)
    pool = sample_prompts(maze, cfg.pool, cfg.seed)
    prompts = [pool[i % len(pool)] for i in range(cfg.steps * cfg.prompts)]
    prompt_len = check_same_prompt(cfg, maze, prompts[0])
    load_before, started = load_average(), time.perf_counter()
    runs = []
    for round_ in range(cfg.rounds):
        for name, fn in (("workbench", run_workbench), ("trl", run_trl)):
            t0 = time.perf_counter()
            rec = fn(cfg, maze, prompts, round_)
            if name == "trl":  # same prompts, same lengths: the workbench's count of all tokens
                rec.total_tokens = [prompt_len * cfg.prompts * cfg.group + c
                                    for c in rec.completion_tokens]
            runs.append(rec)
            gc.collect()
            seconds = time.perf_counter() - t0
            print(f"round {round_} {name:<9}: {len(rec.step_s)} steps, run {seconds:6.1f} s, "
                  f"median step {statistics.median(rec.step_s):.3f} s, reward "
                  f"{rec.reward_mean[0]:.3f} -> {rec.reward_mean[-1]:.3f}", flush=True)
    res = summarize(runs, cfg, args.skip)
    res["setup"] = {
        "config": asdict(cfg), "skip_warmup_steps": args.skip, "prompt_tokens": prompt_len,
        "command": " ".join([Path(sys.executable).relative_to(ROOT).as_posix()
                             if Path(sys.executable).is_relative_to(ROOT) else sys.executable,
                             *sys.argv]) if argv is None else argv,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, no GPU used",
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl.__version__,
        "peft": __import__("peft").__version__,
        "load_average_before": load_before, "load_average_after": load_average(),
        "seconds": time.perf_counter() - started,
    }
    print_summary(res, cfg)
    print(f"load average (1, 5, 15 min) before {load_before}, after "
          f"{res['setup']['load_average_after']}; comparison {res['setup']['seconds']:.0f} s")
    return save_result(res, args.out, args.plot, plot)


if __name__ == "__main__":
    main()
