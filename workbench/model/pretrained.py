"""`tiny-sft`: the pretrained tiny policy that `python -m workbench train`, every notebook and the
demo's GRPO stage start from. Built on first use by a fixed SFT recipe, cached beside the tiny base.

    load_model("tiny-sft")               # builds it the first time (about 4 minutes on 2 cores)
    python -m workbench train            # model.name defaults to tiny-sft
    python -m workbench.rl.pretrained    # build (or find) it and print its report

This module finds or starts the build (model layer: `load_model` resolves the name here); the
build itself is an SFT run, so it lives in `workbench.rl.pretrained` and runs in a child process.

The recipe (`RECIPE`): SFT of the random tiny base ("tiny") with every weight trained, on
noisy-oracle episodes of held-out 9x9 training mazes (VisGym's easy size, 15 turns;
`envs.train_maze`): each turn is the BFS oracle's move, or with probability `noise` a random move
(into a wall too) that stays in context with no loss, so the policy also sees the wall feedback
and the way back from a wrong square. The learning rate falls from its peak to zero on a cosine.
Then the 64 held-out eval mazes, greedy and sampled, are played at 9x9 and at 7x7 (which the tiny
model sees resized, one image token a turn either way) and written to `report.json`, and one line
reports them. The policy it makes solves a fraction of the 9x9 set: most groups of a first GRPO
step have reward variance, and there is room to climb.

Determinism: the build runs in a child process with fixed seeds, float32 on the CPU, `threads`
torch threads and the CPU kernels pinned to AVX2 (`PINNED_ENV`: MKL's conditional numerical
reproducibility, ATen's and oneDNN's instruction sets), so any x86-64 machine with AVX2 and the
locked stack writes the same bytes; tests/test_pretrained.py pins their sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from workbench.model.tiny import TINY_SFT_NAME, build_atomically

PINNED_ENV: dict[str, str] = {
    "MKL_CBWR": "AVX2",  # MKL's conditional numerical reproducibility: one code path everywhere
    "ATEN_CPU_CAPABILITY": "avx2",  # ATen's vectorised kernels (softmax, norms, GELU, ...)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (the patch embedding's convolution)
    "OMP_NUM_THREADS": "2",
    "MKL_NUM_THREADS": "2",
}
"""The child process's environment on top of the caller's: the same kernels on any AVX2 CPU."""


@dataclass(frozen=True)
class PretrainRecipe:
    """The SFT that makes tiny-sft: overrides of the tiny preset, whose keys (`sft.*`, ...) say
    what each setting means. Every field changes the build hash (and the cache folder)."""

    overrides: tuple[str, ...] = (
        "model.name=tiny",
        "env.size=9",  # the tiny model merges a 9x9 maze into one image token
        "generator.max_turns=15",
        "sft.steps=1000",
        "sft.batch_size=4",  # 4 noisy-oracle episodes learnt as much per episode as 8, 10% cheaper
        "sft.learning_rate=0.0007",
        "sft.lr_schedule=cosine",
        "sft.noise=0.2",
        "sft.full_finetune=true",
        "trainer.seed=0",  # the training mazes' offset and the data order
        "eval.n_mazes=64",
        "eval.greedy=true",
        "eval.sampled_passes=2",
        "eval.temperature=0.7",
    )
    """The run config of the build and of its held-out evaluation."""
    report_sizes: tuple[int, ...] = (9, 7)
    """Maze sizes of the held-out evaluation in the report (the first is the trained size)."""
    threads: int = 2
    """Torch threads of the build (part of the arithmetic: reductions split by thread)."""

    def setting(self, key: str) -> str:
        """The value the recipe gives `key`, as written."""
        return settings(self.overrides)[key]

    @property
    def build_hash(self) -> str:
        """Names the cache folder: the recipe and the tiny base's own build hash."""
        from workbench.model.tiny import TinySpec

        text = repr((asdict(self), TinySpec().build_hash))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def settings(overrides: tuple[str, ...] | list[str]) -> dict[str, str]:
    """key -> value of `key=value` overrides."""
    return dict(item.split("=", 1) for item in overrides)


RECIPE = PretrainRecipe()


def tiny_sft_path(recipe: PretrainRecipe = RECIPE, root: str | Path | None = None,
                  log: Any = print) -> Path:
    """The tiny-sft folder, built on first use (in a child process, atomically: temp folder,
    then rename) and reported in one line when built."""
    from workbench.model.tiny import cache_root

    root = Path(root) if root is not None else cache_root()
    final = root / "models" / f"{TINY_SFT_NAME}-{recipe.build_hash}"
    if (final / "report.json").exists():
        return final
    size = recipe.setting("env.size")
    log(f"building {TINY_SFT_NAME} (once; {recipe.setting('sft.steps')} SFT steps on held-out "
        f"{size}x{size} training mazes, then the held-out evaluation) ...")
    build_atomically(final, lambda tmp: _build_in_child(tmp, recipe, root))
    log(describe(read_report(final)) + f" -> {final}")
    return final


def _build_in_child(folder: Path, recipe: PretrainRecipe, root: Path) -> None:
    """`build` in a child process with PINNED_ENV; its stderr tail if it fails."""
    env = os.environ | PINNED_ENV | {"WORKBENCH_CACHE": str(root)}
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(recipe.threads)
    done = subprocess.run(
        [sys.executable, "-m", "workbench.rl.pretrained", "--build", str(folder),
         json.dumps(asdict(recipe))], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {TINY_SFT_NAME} failed (exit {done.returncode}):\n"
                           f"{done.stderr[-3000:]}")


def read_report(folder: str | Path) -> dict[str, Any]:
    """The build report of a tiny-sft folder: recipe, held-out results, seconds, sha256."""
    return json.loads((Path(folder) / "report.json").read_text())


def describe(report: dict[str, Any]) -> str:
    """One line: how long the build took and what the policy solves on each held-out set."""
    parts = []
    for size, r in report["sizes"].items():
        g, s, n = r["greedy"], r["sampled"], r["greedy"]["n_mazes"]
        parts.append(f"{size}x{size} greedy {g['solved']:.1f}/{n}, sampled {s['solved']:.1f}/{n}"
                     f" (ceiling {g['ceiling']}/{n})")
    passes = next(iter(report["sizes"].values()))["sampled"]["episodes_per_maze"]
    return (f"{TINY_SFT_NAME}: built in {report['seconds'] / 60:.1f} min; held-out "
            + "; ".join(parts) + f"; sampled: mean of {passes} passes at "
            f"T={float(settings(report['recipe']['overrides'])['eval.temperature']):g}")


def weights_sha256(folder: str | Path) -> str:
    """sha256 of the folder's model.safetensors (what the determinism test pins)."""
    return hashlib.sha256((Path(folder) / "model.safetensors").read_bytes()).hexdigest()
