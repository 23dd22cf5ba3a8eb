"""Workbench vs TRL's GRPOTrainer on the multi-turn maze: 15 turns, an image every turn.

The task is the workbench's own: `tiny-sft` on 9x9 training mazes (`schedule.step_mazes`, the
same P mazes a step on both sides), up to 15 turns, an image of the maze before every reply,
reward 1.0 for reaching the goal (VisGym's), G samples a maze, LoRA r32 on the language model,
PPO-clip GRPO with group-normalised advantages, no KL, AdamW (0.9, 0.95), grad-norm clip 1.0.

- workbench: `python -m workbench train` as a user runs it (`rl.train.train`, the tiny preset
  with the overrides of `run_config`); its step time is metrics.jsonl's `time/step`.
- TRL: `GRPOTrainer(environment_factory=...)`, TRL's multi-turn path. `MazeTools` is the
  environment: `reset` takes a dataset row (the maze), each move is a tool (`up`, `down`,
  `left`, `right`, `stop`) that steps the workbench's `MazeEnv` and answers with the next image
  and the same user text the workbench shows, `get_reward` is the episode's reward. The model
  replies as it does in the workbench (one word: `up`); TRL reads a word as a tool call through
  a response template (`KEYWORD_TEMPLATE`, transformers' response parsing), and renders tool
  calls and tool answers through `TOOL_CHAT_TEMPLATE`, the tiny model's chat template with tool
  turns, which draws a call as that word and an answer as the workbench's user turn. So both
  sides sample from the same token streams.

Differences that stay (TRL's design): TRL's episode ends when a reply is no tool call, or at
`max_tool_calling_iterations`, or past `max_completion_length`; the environment cannot end it.
After the goal the environment answers "The episode is over." and TRL samples again; the
workbench stops at the goal, and answers an invalid reply with feedback where TRL ends the
episode. TRL keeps zero-advantage rows in the loss; the workbench drops them.

    benchmarks/.trl-venv/bin/python -m benchmarks.trl_multiturn --plot docs/trl_multiturn.png
    benchmarks/.trl-venv/bin/python -m benchmarks.trl_multiturn --smoke   # 2 steps each, 1 round

Printed and written to runs/bench/trl_multiturn.json: median seconds a step (the first step of
each run left out), steps/s, sampled tokens/s, the ratio, the reward and turns per step.

Answers: How does the workbench's multi-turn GRPO compare with TRL's environment loop? Figures:
benchmarks/RESULTS.md, "Multi-turn, against TRL's environment loop".
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.trl_compare import (
    RunRecord,
    load_average,
    lora_settings,
    save_result,
    step_timer,
    timed_phase,
    trl_config,
)
from workbench.config import RunConfig, apply_overrides, preset
from workbench.envs import InitState, MazeEnv, system_prompt
from workbench.model import add_lora, resolve_model_path
from workbench.rl.rollout import user_text
from workbench.rl.schedule import step_mazes

WORDS = ("up", "down", "left", "right", "stop")
SMOOTH = 8  # steps in the plot's moving mean

# a reply that is one of WORDS is a call of the tool of that name, without arguments
KEYWORD_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"(?P<name>" + "|".join(WORDS) + r")",
            "close_pattern": r"<\|im_end\|>\s*",
            "repeats": True,
            "content": "text",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": {}}},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

# the tiny model's chat template, plus: a tool call is drawn as its name (and any arguments as
# key=value), a tool's answer as a user turn (image, then text)
TOOL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + ('user' if message['role'] == 'tool' else message['role']) + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- for call in (message['tool_calls'] if message['tool_calls'] is defined else []) -%}"
    "{{ call['function']['name'] }}"
    "{%- for key, value in (call['function']['arguments'] or {}).items() -%}"
    "{{ ' ' + key + '=' + value | string }}{%- endfor -%}{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class MultiConfig:
    """The shared settings of both trainers."""

    model: str = "tiny-sft"  # start model (model.name)
    steps: int = 40  # optimiser steps per run (fresh mazes every step)
    rounds: int = 2  # runs of each trainer, alternating (round r: trainer.seed r on both)
    prompts: int = 4  # P: mazes per step
    group: int = 4  # G: samples per maze
    turns: int = 15  # replies per episode at most
    max_tokens: int = 4  # reply length cap
    temperature: float = 1.0
    learning_rate: float = 1e-4  # the tiny preset's
    lora_rank: int = 32
    lora_alpha: int = 64
    maze_size: int = 9
    threads: int = 1  # torch threads on both sides
    max_completion_length: int = 3800  # TRL: every turn's reply and tool answer together


def run_config(cfg: MultiConfig, run_dir: str, round_: int) -> RunConfig:
    """The workbench's config: the tiny preset with the shared settings, no eval or saves."""
    P, G = cfg.prompts, cfg.group
    return apply_overrides(preset("tiny"), [
        f"model.name={cfg.model}", f"run_dir={run_dir}", f"trainer.seed={round_}",
        f"env.size={cfg.maze_size}", f"generator.max_turns={cfg.turns}",
        f"generator.max_tokens={cfg.max_tokens}", f"generator.temperature={cfg.temperature}",
        f"generator.n_samples_per_prompt={G}", f"trainer.train_batch_size={P}",
        f"trainer.total_steps={cfg.steps}", f"algorithm.learning_rate={cfg.learning_rate}",
        f"algorithm.minibatch={P * G}", f"lora.rank={cfg.lora_rank}",
        f"lora.alpha={cfg.lora_alpha}", "env.format_weight=0.0", "trainer.eval_interval=0",
        "trainer.ckpt_interval=0", "trainer.hf_save_interval=0", "eval.n_mazes=1",
        "eval.sampled_passes=0", "trainer.keep_step_records=false", "trainer.overwrite=true",
    ])


def run_workbench(cfg: MultiConfig, round_: int) -> RunRecord:
    """`cfg.steps` steps of the workbench's training loop; per step its metrics.jsonl row."""
    from workbench.rl.train import train
    from workbench.run import read_metrics

    rec = RunRecord("workbench", round_, threads=torch.get_num_threads())
    with tempfile.TemporaryDirectory(prefix="trl-multiturn-wb-") as run_dir:
        config = run_config(cfg, run_dir, round_)
        train(config, log=lambda *a, **k: None).session.close()
        rows = [r for r in read_metrics(Path(run_dir)) if "time/step" in r]
    n = cfg.prompts * cfg.group
    for row in rows:
        rec.step_s.append(row["time/step"])
        rec.add_phase("rollout", row["time/rollout"])
        rec.add_phase("update", row["time/update"])
        rec.reward_mean.append(row["reward/mean"])
        rec.completion_tokens.append(round(row["rollout/reply_tokens_mean"] * n))
        rec.total_tokens.append(round(row["rollout/tokens_mean"] * n))
        rec.trained_rows.append(int(row.get("update/datums", 0)))
        rec.add_phase("turns_mean", row["rollout/turns_mean"])
    return rec


def maze_tools(config: RunConfig) -> type:
    """TRL's environment class for `config`'s maze task (one instance per rollout)."""
    from PIL import Image

    task = config.task

    class MazeTools:
        def __init__(self) -> None:
            self.env, self.reward, self.done, self.turns = MazeEnv(task), 0.0, False, 0

        def reset(self, maze_seed: int, size: int, start: list[int], goal: list[int],
                  **_: Any) -> None:
            state = InitState(maze_seed=maze_seed, size=size, start=tuple(start),
                              goal=tuple(goal))
            self.env.reset(options={"init_state": state})
            self.reward, self.done, self.turns = 0.0, False, 1
            return None

        def _act(self, word: str) -> Any:
            if self.done:
                return "The episode is over."
            obs, reward, terminated, truncated, info = self.env.step(word)
            self.reward += float(reward)
            self.done = bool(terminated or truncated)
            self.turns += not self.done
            return [{"type": "image", "image": Image.fromarray(obs["image"])},
                    {"type": "text", "text": user_text(obs, info, task)}]

        def up(self) -> Any:
            """Move one square up."""
            return self._act("up")

        def down(self) -> Any:
            """Move one square down."""
            return self._act("down")

        def left(self) -> Any:
            """Move one square left."""
            return self._act("left")

        def right(self) -> Any:
            """Move one square right."""
            return self._act("right")

        def stop(self) -> Any:
            """End the episode here."""
            return self._act("stop")

        def get_reward(self) -> float:
            return self.reward

    return MazeTools


def trl_rows(config: RunConfig) -> list[dict[str, Any]]:
    """TRL's dataset: step k's P mazes in order, each a prompt (the rules, the first image and
    the first turn's text) and its InitState's fields for `reset`."""
    from PIL import Image

    task, rows = config.task, []
    for step in range(1, config.trainer.total_steps + 1):
        for state in step_mazes(config, step):
            obs, info = MazeEnv(task).reset(options={"init_state": state})
            rows.append({"prompt": [{"role": "system", "content": system_prompt(task)},
                                    {"role": "user", "content": user_text(obs, info, task)}],
                         "image": Image.fromarray(obs["image"]), "maze_seed": state.maze_seed,
                         "size": state.size, "start": list(state.start),
                         "goal": list(state.goal)})
    return rows


def tool_processor(folder: str | Path) -> Any:
    """The folder's processor with TRL's tool turns: TOOL_CHAT_TEMPLATE and KEYWORD_TEMPLATE."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder)
    processor.chat_template = processor.tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    processor.tokenizer.response_template = KEYWORD_TEMPLATE
    return processor


def run_trl(cfg: MultiConfig, round_: int) -> RunRecord:
    """`cfg.steps` steps of TRL's GRPOTrainer with the maze as its environment."""
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, TrainerCallback
    from trl import GRPOTrainer

    from workbench.policy import chat_format

    rec = RunRecord("trl", round_, threads=torch.get_num_threads())
    folder = resolve_model_path(cfg.model)
    processor = tool_processor(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32,
                                                        attn_implementation="sdpa")
    model = add_lora(model, lora_settings(cfg))
    with tempfile.TemporaryDirectory(prefix="trl-multiturn-") as out_dir:
        config = run_config(cfg, out_dir, round_)
        envs: list[Any] = []
        factory = maze_tools(config)

        def make() -> Any:
            envs.append(factory())
            return envs[-1]

        args = trl_config(cfg, out_dir, round_, list(chat_format(processor).banned))
        args.max_completion_length = cfg.max_completion_length
        args.max_tool_calling_iterations = cfg.turns - 1
        sampled: list[int] = []
        trainer = GRPOTrainer(model=model, args=args, processing_class=processor,
                              train_dataset=Dataset.from_list(trl_rows(config)),
                              environment_factory=make,
                              callbacks=[step_timer(TrainerCallback, rec)])
        generate_single = trainer._generate_single_turn

        def counted(*a: Any, **k: Any) -> Any:
            ids, logprobs = generate_single(*a, **k)
            sampled.append(sum(len(x) for x in ids))
            return ids, logprobs

        trainer._generate_single_turn = counted
        rewards = trainer._calculate_rewards

        def scored(inputs: Any, *a: Any, **k: Any) -> Any:
            out = rewards(inputs, *a, **k)
            live = trainer.environments
            rec.reward_mean.append(float(np.mean([e.reward for e in live])))
            rec.add_phase("turns_mean", float(np.mean([e.turns for e in live])))
            rec.completion_tokens.append(sum(sampled))
            rec.trained_rows.append(len(live))
            sampled.clear()
            return out

        trainer._calculate_rewards = scored
        trainer._generate = timed_phase(rec, "rollout", trainer._generate)
        torch.set_num_threads(cfg.threads)
        trainer.train()
    return rec


def summarize(runs: list[RunRecord], skip: int) -> dict[str, Any]:
    """Per trainer: median s/step (after `skip` warm-up steps of each run), steps/s, sampled
    tokens/s, reward and turns per step; the workbench / TRL ratio."""
    out: dict[str, Any] = {}
    for name in ("workbench", "trl"):
        mine = [r for r in runs if r.trainer == name]
        step_s = [s for r in mine for s in r.step_s[skip:]]
        sampled = [c for r in mine for c in r.completion_tokens[skip:]]
        med = statistics.median(step_s)
        out[name] = {"median_step_s": med, "steps_per_s": 1.0 / med,
                     "sampled_tokens_per_s": sum(sampled) / sum(step_s),
                     "reward_curves": [r.reward_mean for r in mine],
                     "turns_mean": [r.phases_s["turns_mean"] for r in mine],
                     "rollout_median_s": statistics.median(
                         v for r in mine for v in r.phases_s["rollout"][skip:]),
                     "runs": [asdict(r) for r in mine]}
    wb, trl = out["workbench"], out["trl"]
    out["ratio_workbench_over_trl"] = {
        "steps_per_s": wb["steps_per_s"] / trl["steps_per_s"],
        "sampled_tokens_per_s": wb["sampled_tokens_per_s"] / trl["sampled_tokens_per_s"]}
    return out


def print_summary(res: dict[str, Any], cfg: MultiConfig) -> None:
    print(f"\nmulti-turn maze GRPO, {cfg.prompts} mazes x {cfg.group} samples, {cfg.turns} "
          f"turns, <= {cfg.max_tokens} tokens a reply, {cfg.steps} steps x {cfg.rounds} runs "
          f"each, {cfg.threads} threads")
    print(f"{'':<10} {'s/step':>8} {'steps/s':>8} {'sampled tok/s':>14} {'rollout s':>10}")
    for name in ("workbench", "trl"):
        r = res[name]
        print(f"{name:<10} {r['median_step_s']:8.2f} {r['steps_per_s']:8.3f} "
              f"{r['sampled_tokens_per_s']:14.1f} {r['rollout_median_s']:10.2f}")
    ratio = res["ratio_workbench_over_trl"]
    print(f"ratio workbench / TRL: steps/s {ratio['steps_per_s']:.2f}x, sampled tokens/s "
          f"{ratio['sampled_tokens_per_s']:.2f}x")
    print("\nstep  reward (wb, trl per run)  turns (wb, trl per run)")
    wb, trl = res["workbench"], res["trl"]
    for s in range(cfg.steps):
        rew = [c[s] for c in wb["reward_curves"] + trl["reward_curves"] if s < len(c)]
        turns = [c[s] for c in wb["turns_mean"] + trl["turns_mean"] if s < len(c)]
        print(f"{s + 1:>4}  " + " ".join(f"{v:.3f}" for v in rew) + "   "
              + " ".join(f"{v:5.1f}" for v in turns))


def plot(res: dict[str, Any], path: Path) -> None:
    """Reward per step of each run, and the median step time of each trainer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6), width_ratios=[2.2, 1])
    for name, colour in (("workbench", "tab:blue"), ("trl", "tab:orange")):
        curves = res[name]["reward_curves"]
        for curve in curves:
            ax.plot(range(1, len(curve) + 1), curve, color=colour, alpha=0.25, lw=1)
        mean = np.mean([c[:min(map(len, curves))] for c in curves], axis=0)
        w = min(SMOOTH, len(mean))
        smooth = np.convolve(mean, np.ones(w) / w, mode="valid")
        ax.plot(np.arange(len(smooth)) + (w + 1) / 2, smooth, color=colour, lw=2.5,
                label=f"{name} (mean of runs, {w}-step window)")
    ax.set(xlabel="GRPO step", ylabel="mean reward (P x G episodes)",
           title="multi-turn maze: reward per step, the same fresh mazes on both")
    ax.legend()
    names = ["workbench", "trl"]
    bx.bar(names, [res[n]["median_step_s"] for n in names], color=["tab:blue", "tab:orange"])
    bx.set(ylabel="median s / step",
           title=f"{res['ratio_workbench_over_trl']['steps_per_s']:.1f}x steps/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import transformers
    import trl

    defaults = MultiConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, value in asdict(defaults).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    ap.add_argument("--smoke", action="store_true", help="2 steps each, 1 round")
    ap.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the medians")
    ap.add_argument("--out", default="runs/bench/trl_multiturn.json")
    ap.add_argument("--plot", default="", help="PNG of the reward curves; empty for none")
    args = ap.parse_args(argv)
    cfg = MultiConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    if args.smoke:
        cfg = MultiConfig(**{**asdict(cfg), "steps": 2, "rounds": 1})
    torch.set_num_threads(cfg.threads)
    load_before, started, runs = load_average(), time.perf_counter(), []
    for round_ in range(cfg.rounds):
        for name, fn in (("workbench", run_workbench), ("trl", run_trl)):
            t0 = time.perf_counter()
            rec = fn(cfg, round_)
            runs.append(rec)
            print(f"round {round_} {name:<9}: {len(rec.step_s)} steps in "
                  f"{time.perf_counter() - t0:6.1f} s, median step "
                  f"{statistics.median(rec.step_s):.2f} s", flush=True)
    res = summarize(runs, min(args.skip, cfg.steps - 1))
    res["setup"] = {
        "config": asdict(cfg), "command": " ".join(sys.argv) if argv is None else argv,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores, no GPU used",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "trl": trl.__version__, "load_average_before": load_before,
        "load_average_after": load_average(), "seconds": time.perf_counter() - started}
    print_summary(res, cfg)
    return save_result(res, args.out, args.plot, plot)


if __name__ == "__main__":
    main()
