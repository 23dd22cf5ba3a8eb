"""Building `tiny-sft` (the recipe, the cache and the child process are in
`workbench.model.pretrained`): SFT of the tiny base, export, the held-out evaluation, the report.

    python -m workbench.rl.pretrained    # build (or find) it and print its report
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from workbench.model.pretrained import (
    PINNED_ENV,
    RECIPE,
    PretrainRecipe,
    describe,
    read_report,
    tiny_sft_path,
    weights_sha256,
)
from workbench.model.tiny import TINY_SFT_NAME

__all__ = ["PINNED_ENV", "RECIPE", "PretrainRecipe", "build", "describe", "read_report",
           "tiny_sft_path", "weights_sha256"]


def build(folder: str | Path, recipe: PretrainRecipe = RECIPE) -> dict[str, Any]:
    """Run the recipe into `folder` in this process (tiny_sft_path runs it in a child with the
    pinned environment): SFT, export, held-out evaluation, report.json. Returns the report."""
    import torch

    from workbench.config import PRESETS, apply_overrides
    from workbench.opener import open_session
    from workbench.rl import phases
    from workbench.rl.schedule import eval_batch
    from workbench.rl.sft import run_sft
    from workbench.session import SessionSpec

    start = time.perf_counter()
    torch.set_num_threads(recipe.threads)
    folder = Path(folder)
    config = apply_overrides(PRESETS["tiny"], list(recipe.overrides) + [f"run_dir={folder}/.sft"])
    model = run_sft(config, log=lambda *_: None)
    for item in model.iterdir():
        shutil.move(str(item), folder / item.name)
    shutil.move(str(folder / ".sft" / "metrics.jsonl"), folder / "sft_metrics.jsonl")
    shutil.rmtree(folder / ".sft")
    session = open_session(SessionSpec(model=str(folder), lora=None,
                                       workdir=str(folder / ".eval")))
    try:
        sampler = session.training_client.save_weights_and_get_sampling_client()
        sizes = {}
        for size in recipe.report_sizes:
            batch = eval_batch(replace(config, env=replace(config.env, size=size)))
            record = phases.evaluate(sampler, batch, TINY_SFT_NAME, config.eval.greedy)
            sizes[str(size)] = {r.mode: r.__dict__ | {"success_rate": r.success_rate,
                                                     "solved": r.solved} for r in record.results}
    finally:
        session.close()
        shutil.rmtree(folder / ".eval", ignore_errors=True)
    report = {"recipe": asdict(recipe), "seconds": time.perf_counter() - start,
              "weights_sha256": weights_sha256(folder), "torch": torch.__version__,
              "sizes": sizes}
    (folder / "report.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str]) -> None:
    """`--build FOLDER RECIPE_JSON` (the child process), or no argument: build or find the
    default and print its report."""
    if argv[:1] == ["--build"]:
        fields = json.loads(argv[2])
        build(argv[1], PretrainRecipe(tuple(fields["overrides"]), tuple(fields["report_sizes"]),
                                      fields["threads"]))
        return
    lines: list[str] = []

    def log(line: str) -> None:
        print(line)
        lines.append(line)

    folder = tiny_sft_path(log=log)
    if not lines:  # found in the cache: report it here
        print(describe(read_report(folder)) + f" -> {folder}")


if __name__ == "__main__":
    main(sys.argv[1:])
