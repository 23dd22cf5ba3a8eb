"""Helpers the notebooks call (kept here, not in cells, so they are tested and reusable).

    config = notebook_config(["env.size=5"], ray_address="", run_dir="runs/nb/00",
                             preset_name="tiny", device="", overrides=["lora.rank=16"])
    model = policy_model("tiny", sft_steps=40, config=config)     # a short oracle SFT first
    proc = start_train_process(overrides, log_path)               # `python -m workbench train`
    rows = live_plot(run_dir, done=lambda: proc.poll() is not None)

What a notebook hands its tests (`record_metrics`) is in `workbench.notebook_checks`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from workbench.config import RunConfig, apply_overrides, preset

# What the notebooks change in each preset so that a step fits a cell: the tiny policy replies
# in two tokens and learns at 1e-3 with a rank-8 adapter; the seed's recipe stands as it is.
NOTEBOOK_TUNING: dict[str, tuple[str, ...]] = {
    "tiny": ("generator.max_tokens=2", "lora.rank=8", "lora.alpha=16", "sft.batch_size=8",
             "sft.learning_rate=3e-3", "algorithm.learning_rate=1e-3"),
    "seed_gpu": (),
}


def notebook_overrides(preset_name: str, settings: list[str], device: str = "",
                       overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The dotted keys a notebook applies to its preset, in order: NOTEBOOK_TUNING[preset_name],
    the notebook's own settings (from its parameters; one whose value is None is left out, so
    the preset's stands), model.device=<device> unless device is "", then `overrides` (the
    OVERRIDES parameter), which win."""
    preset(preset_name)  # a ConfigError naming the presets
    chosen = [s for s in settings if s.partition("=")[2] != "None"]
    placed = [f"model.device={device}"] if device else []
    return [*NOTEBOOK_TUNING.get(preset_name, ()), *chosen, *placed, *overrides]


def notebook_config(settings: list[str], ray_address: str = "", run_dir: str | Path = "",
                    preset_name: str = "tiny", device: str = "",
                    overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """PRESETS[preset_name] with `notebook_overrides`, the cluster address ("" in-process,
    "local", "auto", "ray://host:port") and the run directory."""
    extra = [f"cluster.address={ray_address}"] + ([f"run_dir={run_dir}"] if run_dir else [])
    keys = notebook_overrides(preset_name, settings, device, overrides) + extra
    return apply_overrides(preset(preset_name), keys)


def policy_model(base: str, sft_steps: int, config: RunConfig, out_dir: str | Path = "",
                 log: Any = print) -> str:
    """`base` itself when sft_steps is 0; else `base` after a short oracle SFT (sft.* settings
    of `config`, sft_steps steps) written to <out_dir or run_dir>/sft/model, replacing an earlier
    one there (sft.overwrite: the notebook's own scratch folder; the removal is listed in one
    line). A policy that never emits a valid move gets no reward signal, so most notebooks start
    from such a model."""
    if sft_steps <= 0:
        return base
    from dataclasses import replace

    from workbench.rl.sft import run_sft

    folder = Path(out_dir or config.run_dir) / "sft"
    sft = replace(config, model=replace(config.model, name=base),
                  sft=replace(config.sft, steps=sft_steps, overwrite=True), run_dir=str(folder))
    return str(run_sft(sft, log=log))


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """metrics.jsonl rows without their wall-clock timings (time/*), for exact comparison."""
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def start_train_process(overrides: list[str], log_path: str | Path,
                        env: dict[str, str] | None = None,
                        preset_name: str = "tiny") -> subprocess.Popen:
    """`python -m workbench train --preset <preset_name> <overrides>` as a child process,
    output to log_path."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "workbench", "train", "--preset", preset_name, *overrides]
    with open(log_path, "w") as log:
        return subprocess.Popen(command,
                                stdout=log, stderr=subprocess.STDOUT, env=env or dict(os.environ))


def kill_process(proc: subprocess.Popen) -> int:
    """SIGKILL (no chance to clean up, as a crash or a lost node) and wait; the return code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    return proc.wait()


def live_plot(run_dir: str | Path, done: Callable[[], bool], every_s: float = 1.0,
              timeout_s: float = 600.0, title: str = "GRPO") -> list[dict[str, Any]]:
    """Redraw plot_training from metrics.jsonl whenever it grows, until done() is true (or
    timeout_s passes); returns the rows read last. Reads the file only: works on any run."""
    from IPython.display import clear_output, display

    from workbench.deps import require
    from workbench.run import read_metrics
    from workbench.viz import plot_training

    plt = require("matplotlib.pyplot")
    shown, deadline = -1, time.monotonic() + timeout_s
    while True:
        finished = done() or time.monotonic() > deadline
        rows = read_metrics(run_dir)
        if len(rows) != shown or finished:
            fig = plot_training(rows, title)
            clear_output(wait=True)
            display(fig)
            plt.close(fig)
            shown = len(rows)
        if finished:
            return rows
        time.sleep(every_s)


def evaluate_model(config: RunConfig, model: str, adapter: str | Path = "",
                   name: str = "policy") -> Any:
    """`rl.eval_model.evaluate_model`, quietly (a notebook cell prints its own table)."""
    from workbench.rl.eval_model import evaluate_model as evaluate

    return evaluate(config, model, adapter, name, log=lambda *_: None)


def failure_table(records: dict[str, Any], mode: str = "greedy") -> dict[str, dict[str, int]]:
    """Failed episodes per policy counted by reason (rl.evaluate.failure_reason)."""
    from collections import Counter

    from workbench.rl.evaluate import failure_reason

    table = {}
    for name, record in records.items():
        reasons = Counter(failure_reason(ep) for group in record.episodes[mode] for ep in group)
        reasons.pop("solved", None)
        table[name] = dict(sorted(reasons.items()))
    return table
