"""What limits the tiny policy: SFT of a tiny Qwen3-VL variant, then the held-out evaluation.

The rows of the README's "What moved the numbers" table come from this script (SFT variants) and
from `python -m workbench train` (GRPO from the folders it writes). Each run builds a tiny
Qwen3-VL of the given shape, runs the project's own SFT (`rl.sft.run_sft`: oracle episodes of
held-out 7x7 training mazes, with `--noise` random moves in context), exports the model and
evaluates it on the 64 held-out eval mazes (greedy and sampled), with two probes:

- single-turn accuracy: one image with the agent on each open square of each eval maze (no
  history), is the argmax the oracle's move? It asks whether the policy reads the maze;
- blind: the same greedy evaluation with the walls of another maze drawn, and with the agent
  drawn on the goal: a policy that ignores the image loses nothing.

    python benchmarks/learning.py --steps 1000 --noise 0.2 --out runs/learn/merge7
    python benchmarks/learning.py --steps 1000 --patch 16 --merge 2 --px 32 --vision-hidden 128 \\
        --vision-intermediate 256 --deepstack 1 --out runs/learn/squares   # one token a square
    python -m workbench train model.name=runs/learn/merge7 run_dir=runs/learn/grpo ...

Prints one JSON line per evaluation; `--eval-every N` adds evaluations during the SFT.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from workbench.config import PRESETS, apply_overrides
from workbench.envs import (
    MazeConfig,
    eval_set,
    init_maze,
    make_maze,
    render_image,
    shortest_path,
    system_prompt,
)
from workbench.envs.env import budget_text
from workbench.model import TinySpec, build_tiny, load_model
from workbench.policy import SamplingParams, append_user, chat_format, encode_image, start_stream
from workbench.policy.forward import forward_logits, make_batch
from workbench.rl import play_model, summarize


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    spec = TinySpec()
    for field in ("hidden", "layers", "heads", "head_dim", "intermediate", "vision_hidden",
                  "vision_heads", "vision_depth", "vision_intermediate", "patch", "merge"):
        p.add_argument("--" + field.replace("_", "-"), type=int, default=getattr(spec, field))
    p.add_argument("--deepstack", default="", help="comma-separated vision layers ('' = none)")
    p.add_argument("--px", type=int, default=16, help="pixels per maze square")
    p.add_argument("--steps", type=int, default=1000, help="SFT steps")
    p.add_argument("--batch", type=int, default=2, help="episodes per SFT step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--noise", type=float, default=0.2, help="random moves in context")
    p.add_argument("--passes", type=int, default=2, help="sampled passes in the evaluation")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/learn/model", help="folder of the SFT run and model")
    p.add_argument("--probes", action="store_true", help="single-turn accuracy and blind probes")
    return p.parse_args(argv)


def spec_of(args: argparse.Namespace) -> TinySpec:
    """The TinySpec the arguments describe (min_pixels low enough for 7 squares of 16 px)."""
    fields = {f.name for f in dataclasses.fields(TinySpec)}
    given = {k: v for k, v in vars(args).items() if k in fields and k != "deepstack"}
    deepstack = tuple(int(x) for x in args.deepstack.split(",") if x)
    return dataclasses.replace(TinySpec(), **given, deepstack=deepstack, kv_heads=args.heads)


def evaluate(folder: Path, config: MazeConfig, passes: int, device: str) -> dict[str, float]:
    """Held-out greedy and sampled success (%) and mean turns."""
    lm = load_model(str(folder), device=device)
    states, out = eval_set(config.size), {}
    for mode, n, temp in (("greedy", 1, 0.0), ("sampled", passes, 1.0)):
        eps = play_model(lm, config, states, n, SamplingParams(max_tokens=4, temperature=temp),
                         torch.Generator().manual_seed(12345))
        r = summarize("x", mode, eps, states, config)
        out |= {mode: round(100 * r.success_rate, 1), f"{mode}_turns": round(r.mean_turns, 2)}
    return out


def single_turn_accuracy(folder: Path, config: MazeConfig, device: str) -> float:
    """Share of (eval maze, open square) where the first-turn argmax is the oracle's move."""
    lm = load_model(str(folder), device=device)
    fmt, tok = chat_format(lm.processor), lm.processor.tokenizer
    ids = [tok.convert_tokens_to_ids(w) for w in ("right", "up", "left", "down")]
    head = start_stream(lm.processor, fmt, system_prompt(config))
    right = total = 0
    for state in eval_set(config.size):
        maze = init_maze(state)
        squares = [(r, c) for r in range(maze.size) for c in range(maze.size)
                   if not maze.walls_HW[r, c] and (r, c) != maze.goal]
        images = [render_image(maze, pos, config.px_per_cell) for pos in squares]
        streams = [append_user(head, lm.processor, fmt, budget_text(0, config.max_turns),
                               encode_image(lm.processor, image)) for image in images]
        with torch.no_grad():
            batch = make_batch(lm.model, streams, tok.pad_token_id, left=True)
            moves = forward_logits(lm.model, batch).logits[:, -1, ids].argmax(-1).tolist()
        right += sum(m == shortest_path(maze, pos, maze.goal)[0] for m, pos in zip(moves, squares))
        total += len(squares)
    return round(right / total, 3)


def blind_probe(folder: Path, config: MazeConfig, device: str) -> dict[str, float]:
    """Greedy success (%) when the image lies: another maze's walls, or the agent on the goal."""
    import workbench.envs.env as env_module

    lm, states, original = load_model(str(folder), device=device), eval_set(config.size), \
        env_module.render_image
    other = make_maze(config.size, 999_999)
    lies = {"walls_of_another_maze": lambda m, pos, px: original(
                dataclasses.replace(m, walls_HW=other.walls_HW), pos, px),
            "agent_drawn_on_goal": lambda m, pos, px: original(m, m.goal, px)}
    out = {}
    for name, render in lies.items():
        env_module.render_image = render
        try:
            eps = play_model(lm, config, states, 1, SamplingParams(max_tokens=4, temperature=0.0))
        finally:
            env_module.render_image = original
        out[name] = round(100 * summarize("x", "greedy", eps, states, config).success_rate, 1)
    return out


def main(argv: list[str] | None = None) -> dict:
    from workbench.rl.sft import run_sft

    args = parse(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    spec = spec_of(args)
    base = build_tiny(out.parent / f".base-{spec.build_hash}", spec)
    config = apply_overrides(PRESETS["tiny"], [
        f"model.name={base}", f"model.device={args.device}", f"env.px_per_cell={args.px}",
        f"sft.steps={args.steps}", f"sft.batch_size={args.batch}", f"sft.learning_rate={args.lr}",
        f"sft.noise={args.noise}", "sft.full_finetune=true", "sft.overwrite=true",
        f"run_dir={out}"])
    start = time.perf_counter()
    model = run_sft(config, log=lambda *_: None)
    result = {"args": vars(args), "sft_seconds": round(time.perf_counter() - start, 1),
              "params": sum(p.numel() for p in load_model(str(model)).model.parameters()),
              **evaluate(model, config.task, args.passes, args.device)}
    if args.probes:
        result |= {"single_turn_accuracy": single_turn_accuracy(model, config.task, args.device),
                   "greedy_when_the_image_lies": blind_probe(model, config.task, args.device)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
