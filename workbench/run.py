"""What a run writes into its folder besides checkpoints: config, manifest, metrics, eval
results, step records (the layout and the checkpoints: workbench.runfolder).

    run_dir/
      config.json  manifest.json  metrics.jsonl          flat namespaced scalars, one row a step
      tensorboard/  mlflow.db  mlflow_run.json           the same rows, with trainer.logger
      eval/step_000010.json                              per-maze outcomes of each evaluation
      steps/step_000007/{episodes.json,datums.safetensors}   what step 7 trained on (replay)

Step records keep each datum's tokens and side tables as safetensors and each image as the
(maze, position) it was rendered from, so `replay` rebuilds the exact batch without pickles.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import platform
import subprocess
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from workbench import loggers
from workbench.envs import Maze, render_image
from workbench.loggers import read_metrics
from workbench.policy import Stream, encode_image
from workbench.session.types import Datum


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("workbench", "torch", "torchvision", "transformers", "peft", "numpy", "ray"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def source_hash(*objects: Any) -> str:
    """sha256 of the source code of functions/classes (e.g. the reward functions)."""
    digest = hashlib.sha256()
    for obj in objects:
        digest.update(inspect.getsource(obj).encode())
    return digest.hexdigest()


def write_manifest(run_dir: Path, config: dict, session_info: dict, reward_sources: list,
                   torch_threads: int | None = None) -> None:
    """manifest.json: versions, git commit, seeds, the trainer's torch threads (None: not
    known here, e.g. on Ray actors), model id + weights hash, reward source hash."""
    manifest = {
        "versions": _versions(),
        "git_commit": _git_commit(),
        "seed": config["trainer"]["seed"],
        "torch_threads": torch_threads,
        "model": session_info,
        "reward_source_sha256": source_hash(*reward_sources),
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))


def append_metrics(run_dir: Path, row: dict[str, Any], logger: str = "jsonl") -> None:
    """One JSON line of flat scalars in metrics.jsonl (always), then the same row to the other
    loggers that `logger` (trainer.logger, e.g. "jsonl,tensorboard") names: workbench.loggers."""
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    loggers.log_row(run_dir, row, logger)


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """Keep rows up to last_step (a resumed run rewrites what came after its checkpoint); a
    TensorBoard file gets a restart marker there (workbench.loggers.restart)."""
    rows = [r for r in read_metrics(run_dir) if r["step"] <= last_step]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loggers.restart(run_dir, last_step + 1)


def save_step_record(folder: Path, episodes_P_G: list[list[dict[str, Any]]],
                     rewards_P_G: np.ndarray, advantages_P_G: np.ndarray,
                     datum_index: list[tuple[int, int]], datums: list[Datum],
                     extra: dict[str, Any]) -> None:
    """episodes.json (every episode's summary, rl.rollout.episode_summary; rewards, advantages)
    + datums.safetensors (the batch)."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"episodes_P_G": episodes_P_G,
              "rewards_P_G": rewards_P_G.tolist(), "advantages_P_G": advantages_P_G.tolist(),
              "datum_index": datum_index} | extra
    tensors: dict[str, torch.Tensor] = {}
    for k, d in enumerate(datums):
        s = d.stream
        tensors |= {f"{k}.tokens": torch.tensor(s.tokens_T), f"{k}.mm_types": torch.tensor(
            s.mm_types_T), f"{k}.loss_mask": torch.tensor(s.loss_mask_T),
            f"{k}.logprobs": torch.tensor(s.logprobs_T, dtype=torch.float32),
            f"{k}.advantages": torch.tensor(d.advantages_T, dtype=torch.float64),
            f"{k}.weights": torch.tensor(d.weights_T, dtype=torch.float64)}
    save_file(tensors, str(folder / "datums.safetensors"))
    (folder / "episodes.json").write_text(json.dumps(record))


def load_step_record(folder: Path) -> dict[str, Any]:
    """The episodes.json of a step record."""
    return json.loads((Path(folder) / "episodes.json").read_text())


def load_datums(folder: Path, processor: Any, maze_of: Callable[[dict[str, Any]], Maze],
                px_per_cell: int) -> list[Datum]:
    """Rebuild the exact datums of a step (images re-rendered from the grid of each recorded
    initial state, `maze_of`: `envs.tasks.TaskEntry.recorded_maze`, and its positions)."""
    record = load_step_record(folder)
    tensors = load_file(str(Path(folder) / "datums.safetensors"))
    datums = []
    for k, (p, g) in enumerate(record["datum_index"]):
        ep = record["episodes_P_G"][p][g]
        maze = maze_of(ep["init_state"])
        n_images = int((tensors[f"{k}.tokens"] == processor.tokenizer.convert_tokens_to_ids(
            "<|vision_start|>")).sum())
        # the datum's images are those of the turns up to its last reply (the last n of them
        # under an image window: generator.history_images)
        mask = tensors[f"{k}.loss_mask"].tolist()
        replies = sum(1 for t, m in enumerate(mask) if m and (t == 0 or not mask[t - 1]))
        images = tuple(encode_image(processor, render_image(maze, tuple(pos), px_per_cell))
                       for pos in ep["positions"][replies - n_images:replies])
        stream = Stream(tokens_T=tensors[f"{k}.tokens"].tolist(),
                        mm_types_T=tensors[f"{k}.mm_types"].tolist(),
                        loss_mask_T=tensors[f"{k}.loss_mask"].tolist(),
                        logprobs_T=tensors[f"{k}.logprobs"].tolist(), images=images)
        datums.append(Datum(stream, tuple(tensors[f"{k}.advantages"].tolist()),
                            tuple(tensors[f"{k}.weights"].tolist())))
    return datums


def write_json(path: Path, data: Any) -> None:
    """Write JSON, creating the parent folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable))


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
