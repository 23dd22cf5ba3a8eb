"""The main job on the embedded default: the pretrained tiny policy -> GRPO, evaluated on
held-out mazes before, during and after.

    make demo        # = python -m workbench demo --out runs/demo      (under 15 minutes, 2 cores)
    make demo-long   # = python -m workbench demo --out runs/demo-long --long   (under 60)

1. Baselines on the fixed 64-maze set (VisGym's easy 9x9 mazes, 15 turns, ceiling 50/64):
   random, random-among-open-moves, oracle.
2. The pretrained tiny policy `tiny-sft` (`workbench.rl.pretrained`): built on first use, in
   about six minutes, and reported; cached after that.
3. GRPO with LoRA on top of it -> runs/demo/grpo (metrics, checkpoints, exports), evaluated on the
   held-out set every `EVAL_EVERY` steps, greedy and sampled.
4. The seed-style table (SFT baseline X/64 -> GRPO Y/64, ceiling Z/64), greedy and sampled
   separately (sampled success is the mean of the passes), and two pictures: training.png
   (rollouts, behaviour per step, and the eval curves with their 95% noise band) and
   episodes.png.

No maze of the eval set, nor any maze with the same walls and goal, is ever trained on
(`envs.train_maze`).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from workbench.config import PRESETS, RunConfig, apply_overrides
from workbench.envs.tasks import SCRIPTED
from workbench.rl import EvalResult, format_table, play_scripted, summarize
from workbench.rl.schedule import eval_batch

EVAL_EVERY = 4
"""Steps between evaluations on the held-out set (and the curve's points)."""

DEMO_OVERRIDES = [
    "model.name=tiny-sft", "trainer.total_steps=84", "trainer.train_batch_size=8",
    "generator.n_samples_per_prompt=8", "algorithm.learning_rate=5e-4",
    "algorithm.loss_reduction=sequence_mean", "algorithm.step_advantage=1.0",
    f"trainer.eval_interval={EVAL_EVERY}",
    "trainer.ckpt_interval=20", "trainer.hf_save_interval=20", "eval.sampled_passes=2",
]
LONG_OVERRIDES = DEMO_OVERRIDES + ["trainer.total_steps=60"]
LONG_SFT_OVERRIDES = [
    "sft.steps=8000", "sft.batch_size=4", "sft.learning_rate=5e-4", "sft.lr_schedule=cosine",
    "sft.noise=0.2", "sft.full_finetune=true", "trainer.seed=1"]
"""--long first continues tiny-sft's SFT (8000 more full fine-tuning steps at a cosine-decayed
5e-4 on fresh training mazes: trainer.seed=1), then runs GRPO from that model."""


def demo_config(out: Path, long: bool = False, overrides: tuple[str, ...] = ()) -> RunConfig:
    """The demo's settings: tiny preset + DEMO_OVERRIDES (or LONG_OVERRIDES) + overrides."""
    chosen = LONG_OVERRIDES if long else DEMO_OVERRIDES
    return apply_overrides(PRESETS["tiny"], chosen + [f"run_dir={out / 'grpo'}", *overrides])


def baselines(config: RunConfig) -> list[EvalResult]:
    """Scripted policies on the fixed set of env.task."""
    b = eval_batch(config)
    return [summarize(name, "scripted", play_scripted(policy, b.task, b.states_P), b.states_P,
                      b.task) for name, policy in SCRIPTED.items()]


def seed_table(before: list[EvalResult], after: list[EvalResult]) -> str:
    """SFT baseline X/N -> GRPO Y/N (ceiling Z/N), one line per decoding mode."""
    lines = []
    for b in before:
        a = next(r for r in after if r.mode == b.mode)
        passes = f", mean of {b.episodes_per_maze} passes" if b.episodes_per_maze > 1 else ""
        lines.append(f"{b.mode:<8} SFT baseline {b.solved:5.1f}/{b.n_mazes} -> GRPO "
                     f"{a.solved:5.1f}/{a.n_mazes}   (ceiling {b.ceiling}/{b.n_mazes}{passes})")
    return "\n".join(lines)


def run_demo(out: str | Path, long: bool = False, overrides: tuple[str, ...] = ()) -> dict:
    """Baselines, the pretrained policy, GRPO, tables and pictures; returns the summary written
    to summary.json."""
    from workbench.model.load import resolve_model_path
    from workbench.rl.train import train

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = demo_config(out, long, overrides)
    t0 = time.perf_counter()
    base = baselines(config)
    print(format_table(base))
    # builds tiny-sft once, and says so
    start_model: str | Path = resolve_model_path(config.model.name)
    if long:
        start_model = more_sft(long_sft_config(out, overrides))
    t_start_model = time.perf_counter() - t0
    grpo_cfg = replace(config, model=replace(config.model, name=str(start_model)),
                       # the demo's own folder: a second `make demo` replaces the first and
                       # lists what it removes (trainer.overwrite)
                       trainer=replace(config.trainer, resume_mode="none", overwrite=True))
    trainer = train(grpo_cfg)
    evals = sorted((out / "grpo" / "eval").glob("step_*.json"))
    before = [EvalResult(**_tuple(r)) for r in json.loads(evals[0].read_text())["results"]]
    after = [EvalResult(**_tuple(r)) for r in json.loads(evals[-1].read_text())["results"]]
    table = seed_table(before, after)
    print(format_table(base + [replace(r, policy="sft") for r in before]
                       + [replace(r, policy="grpo") for r in after]))
    print(table)
    title = "GRPO from tiny-sft" + (" + more SFT" if long else "")
    _pictures(out, trainer, title)
    summary: dict[str, Any] = {
        "seconds_total": time.perf_counter() - t0, "seconds_start_model": t_start_model,
        "start_model": str(start_model), "table": table,
        "baselines": [r.__dict__ for r in base],
        "sft": [r.__dict__ for r in before], "grpo": [r.__dict__ for r in after]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"total {summary['seconds_total'] / 60:.1f} min; wrote {out}/summary.json, "
          f"training.png, episodes.png")
    return summary


def long_sft_config(out: Path, overrides: tuple[str, ...] = ()) -> RunConfig:
    """--long's SFT stage: the demo's settings + LONG_SFT_OVERRIDES + overrides, into out/sft."""
    chosen = DEMO_OVERRIDES + LONG_SFT_OVERRIDES
    return apply_overrides(PRESETS["tiny"], chosen + [f"run_dir={out / 'sft'}",
                                                      "sft.overwrite=true", *overrides])


def more_sft(config: RunConfig) -> Path:
    """--long's first stage: SFT of config.model.name by config.sft -> <run_dir>/model."""
    from workbench.rl.sft import run_sft

    print(f"SFT: {config.sft.steps} more steps on {config.model.name} -> {config.run_dir}/model")
    return run_sft(config)


def _tuple(result: dict) -> dict:
    return result | {"successes_P": tuple(result["successes_P"])}


def _pictures(out: Path, trainer, title: str) -> None:
    from workbench.run import read_metrics
    from workbench.viz import episode_grid, plot_training

    plot_training(read_metrics(out / "grpo"), title).savefig(
        out / "training.png", dpi=80)
    episodes = trainer.last_eval.episodes
    mode = "sampled" if "sampled" in episodes else "greedy"
    eps = [g[0] for g in episodes[mode][:8]]
    episode_grid(eps, trainer.config.task, titles=[f"grpo {mode}"] * len(eps)).savefig(
        out / "episodes.png", dpi=80)
