"""`make demo`'s code path at toy scale: tables, summary and pictures are produced."""

from __future__ import annotations

import json
from pathlib import Path

from workbench.demo import run_demo, seed_table
from workbench.rl.evaluate import EvalResult
from workbench.run import read_metrics


def test_demo_runs_end_to_end_at_toy_scale(sft_model: str, tmp_path: Path) -> None:
    summary = run_demo(tmp_path, overrides=(
        f"model.name={sft_model}", "generator.max_turns=8",
        "trainer.total_steps=2", "trainer.train_batch_size=2", "generator.n_samples_per_prompt=2",
        "eval.n_mazes=4", "eval.sampled_passes=1", "trainer.eval_interval=1", "lora.rank=4",
        "lora.alpha=8"))
    assert json.loads((tmp_path / "summary.json").read_text())["table"] == summary["table"]
    from PIL import Image

    assert Image.open(tmp_path / "training.png").size == (1040, 680)  # 13 x 8.5 in at 80 dpi
    assert Image.open(tmp_path / "episodes.png").size[0] == 960  # 4 columns x 3 in at 80 dpi
    assert summary["start_model"] == sft_model
    assert (tmp_path / "grpo" / "exports" / "global_step_2" / "adapter_model.safetensors").exists()
    assert [r["mode"] for r in summary["grpo"]] == ["greedy", "sampled"]
    assert [r["step"] for r in read_metrics(tmp_path / "grpo") if "eval/n_mazes" in r] == [0, 1, 2]


def test_seed_table_lines() -> None:
    def result(mode: str, solved: tuple[int, ...], passes: int) -> EvalResult:
        return EvalResult("p", mode, 4, passes, solved, 9.0, 0.5, 3)

    table = seed_table([result("greedy", (1, 0, 0, 1), 1), result("sampled", (1, 1, 0, 2), 2)],
                       [result("greedy", (1, 1, 1, 1), 1), result("sampled", (2, 2, 0, 2), 2)])
    assert table.splitlines() == [
        "greedy   SFT baseline   2.0/4 -> GRPO   4.0/4   (ceiling 3/4)",
        "sampled  SFT baseline   2.0/4 -> GRPO   3.0/4   (ceiling 3/4, mean of 2 passes)",
    ]


def test_long_demo_runs_its_sft_stage_first(sft_model: str, tmp_path: Path) -> None:
    small = ("generator.max_turns=6", "trainer.total_steps=1", "trainer.train_batch_size=2",
             "generator.n_samples_per_prompt=2", "eval.n_mazes=2", "eval.sampled_passes=0",
             "trainer.eval_interval=1", "lora.rank=4", "lora.alpha=8", "sft.steps=2")
    summary = run_demo(tmp_path, long=True, overrides=(f"model.name={sft_model}", *small))
    assert summary["start_model"] == str(tmp_path / "sft" / "model")
    sft_rows = read_metrics(tmp_path / "sft")
    assert [r["step"] for r in sft_rows] == [1, 2]
    config = json.loads((tmp_path / "grpo" / "config.json").read_text())
    assert config["model"]["name"] == summary["start_model"]
