"""Command line: `python -m workbench <command> [--preset NAME] [section.key=value ...]`.

    python -m workbench sft    sft.steps=300 run_dir=runs/sft
    python -m workbench train  model.name=runs/sft/model trainer.total_steps=40 run_dir=runs/grpo
    python -m workbench eval   model.name=runs/sft/model --adapter runs/grpo/exports/global_step_40
    python -m workbench replay runs/grpo --step 7
    python -m workbench demo   (the whole SFT -> GRPO demo; see `make demo`)

`python -m workbench train --help` lists every key with its default and meaning.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workbench.config import PRESETS, ConfigError, RunConfig, apply_overrides, describe_keys
from workbench.model.lora import LoraSettings


def _config(args: argparse.Namespace) -> RunConfig:
    if args.preset not in PRESETS:
        raise ConfigError(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    return apply_overrides(PRESETS[args.preset], args.overrides)


def _train(args: argparse.Namespace) -> None:
    from workbench.rl.train import train

    train(_config(args))


def _sft(args: argparse.Namespace) -> None:
    from workbench.rl.sft import run_sft

    print(f"SFT model written to {run_sft(_config(args))}")


def _eval(args: argparse.Namespace) -> None:
    from workbench.envs import eval_set
    from workbench.rl import format_table
    from workbench.rl.phases import evaluate
    from workbench.session import create_session

    config = _config(args)
    lora = adapter_settings(args.adapter) if args.adapter else None
    session = create_session(config.model.name, lora, workdir=config.run_dir)
    if args.adapter:
        session.training_client.load_adapter(args.adapter).result()
    sampler = session.training_client.save_weights_and_get_sampling_client()
    record = evaluate(sampler, config.maze, eval_set(config.env.size, config.eval.n_mazes),
                      args.adapter or config.model.name, config.eval.greedy,
                      config.eval.sampled_passes, config.eval.temperature,
                      config.generator.max_tokens)
    print(format_table(record.results))


def adapter_settings(folder: str) -> LoraSettings:
    """LoRA rank / alpha read from an adapter folder's adapter_config.json."""
    cfg = json.loads((Path(folder) / "adapter_config.json").read_text())
    return LoraSettings(rank=int(cfg["r"]), alpha=int(cfg["lora_alpha"]))


def _replay(args: argparse.Namespace) -> None:
    from workbench.rl.replay import replay

    result = replay(args.run_dir, args.step)
    for key in result.logged:
        print(f"{key:<28} logged {result.logged[key]!r:<24} replayed {result.replayed[key]!r}")
    print("exact" if result.exact else "DIFFERENT")
    if not result.exact:
        sys.exit(1)


def _demo(args: argparse.Namespace) -> None:
    from workbench.demo import run_demo

    run_demo(args.out, long=args.long)


def _with_overrides(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--preset", default="tiny", help=f"one of {sorted(PRESETS)}")
    sub.add_argument("overrides", nargs="*", metavar="section.key=value",
                     help="dotted config overrides (listed below)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-command per entry point."""
    keys = "config keys (defaults of the tiny preset):\n" + describe_keys(RunConfig())
    parser = argparse.ArgumentParser(prog="python -m workbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, text in (("train", _train, "GRPO training loop"),
                           ("sft", _sft, "SFT baseline on oracle trajectories"),
                           ("eval", _eval, "evaluate a model (and adapter) on the fixed set")):
        p = sub.add_parser(name, help=text, description=text, epilog=keys,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        _with_overrides(p)
        if name == "eval":
            p.add_argument("--adapter", default="", help="PEFT adapter folder to evaluate")
        p.set_defaults(func=fn)
    rp = sub.add_parser("replay", help="re-run a recorded step's update and compare")
    rp.add_argument("run_dir")
    rp.add_argument("--step", type=int, required=True)
    rp.set_defaults(func=_replay)
    demo = sub.add_parser("demo", help="SFT baseline -> GRPO on the tiny default, with plots")
    demo.add_argument("--out", default="runs/demo", help="output folder")
    demo.add_argument("--long", action="store_true", help="the longer run (make demo-long)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse argv and run the chosen command; config errors print one clear line."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
