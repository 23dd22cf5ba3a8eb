"""`make demo`'s code path at toy scale: tables, summary and pictures are produced."""

from __future__ import annotations

import json
from pathlib import Path

from workbench.demo import run_demo, seed_table
from workbench.rl.evaluate import EvalResult


def test_demo_runs_end_to_end_at_toy_scale(tiny_dir: Path, tmp_path: Path) -> None:
    summary = run_demo(tmp_path, overrides=(
        f"model.name={tiny_dir}", "env.size=5", "generator.max_turns=5", "sft.steps=3",
        "trainer.total_steps=2", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2",
        "eval.n_mazes=4", "eval.sampled_passes=1", "trainer.eval_interval=1", "lora.rank=4",
        "lora.alpha=8"))
    assert json.loads((tmp_path / "summary.json").read_text())["table"] == summary["table"]
    from PIL import Image

    assert Image.open(tmp_path / "training.png").size == (880, 304)  # 11 x 3.8 in at 80 dpi
    assert Image.open(tmp_path / "episodes.png").size[0] == 960  # 4 columns x 3 in at 80 dpi
    assert (tmp_path / "sft" / "model" / "config.json").exists()
    assert (tmp_path / "grpo" / "exports" / "global_step_2" / "adapter_model.safetensors").exists()
    assert [r["mode"] for r in summary["grpo"]] == ["greedy", "sampled"]


def test_seed_table_lines() -> None:
    def result(mode: str, solved: tuple[int, ...], passes: int) -> EvalResult:
        return EvalResult("p", mode, 4, passes, solved, 9.0, 0.5, 3)

    table = seed_table([result("greedy", (1, 0, 0, 1), 1), result("sampled", (1, 1, 0, 2), 2)],
                       [result("greedy", (1, 1, 1, 1), 1), result("sampled", (2, 2, 0, 2), 2)])
    assert table.splitlines() == [
        "greedy   SFT baseline   2.0/4 -> GRPO   4.0/4   (ceiling 3/4)",
        "sampled  SFT baseline   2.0/4 -> GRPO   3.0/4   (ceiling 3/4, mean of 2 passes)",
    ]
