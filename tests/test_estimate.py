"""workbench.estimate: a pilot's metrics.jsonl and folder projected to a full run, exactly."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.config import ModelConfig, RunConfig, TrainerConfig, to_dict
from workbench.estimate import estimate
from workbench.session.spec import ClusterSpec

# step 1 is warm-up; steps 2-4 take 2.0, 3.0, 2.5 s: the median is step 4's 2.5 s
STEPS = [(1, 9.0, 6.0, 1.0, 1.0), (2, 2.0, 1.0, 0.25, 0.5), (3, 3.0, 1.5, 0.25, 1.0),
         (4, 2.5, 1.0, 0.25, 1.0)]  # step, time/step, rollout_wait, weight_sync, update
EVALS = [(0, 9.0), (2, 2.0), (4, 3.0)]  # step 0's is warm-up: the median is 2.5 s


def _files(folder: Path, span: float) -> None:
    folder.mkdir(parents=True)
    for name, when in (("a", 1000.0), ("b", 1000.0 + span)):
        (folder / name).write_text(name)
        os.utime(folder / name, (when, when))


def _pilot(run: Path, config: RunConfig) -> Path:
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(config)))
    evals = {s: {"step": s, "time/eval": t, "eval/n_mazes": 16} for s, t in EVALS}
    rows = [evals[0]]
    for s, step, wait, sync, update in STEPS:
        rows.append({"step": s, "reward/mean": 0.5, "time/step": step, "time/rollout": wait,
                     "time/rollout_wait": wait, "time/weight_sync": sync, "time/update": update})
        rows += [evals[s]] if s in evals else []
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _files(run / "checkpoints" / "global_step_0", 1.5)
    _files(run / "exports" / "global_step_4", 0.5)
    return run


def _config(device: str = "cuda") -> RunConfig:
    return RunConfig(
        model=ModelConfig(device=device),
        trainer=TrainerConfig(total_steps=10, eval_interval=4, ckpt_interval=5, hf_save_interval=4),
        cluster=ClusterSpec(address="local", num_workers=2, num_engines=1, colocate_all=True))


def test_a_pilot_projects_to_exact_seconds_and_cost(tmp_path: Path) -> None:
    record = estimate(_pilot(tmp_path / "pilot", _config()), price_per_gpu_hour=3.6)
    assert record.pilot_steps == (2, 3, 4) and record.gpus == 2  # colocated: max(2, 1)
    got = {p.phase: (p.seconds, p.count) for p in record.phases}
    assert got == {"rollout": (1.0, 10), "weight_sync": (0.25, 10), "update": (1.0, 10),
                   "step_rest": (0.25, 10), "eval": (2.5, 4),  # steps 0, 4, 8, 10
                   "checkpoint": (1.5, 3), "export": (0.5, 3)}  # 0, 5, 10 | 4, 8, 10
    assert record.wall_s == 25.0 + 10.0 + 4.5 + 1.5 == 41.0
    assert record.cost == pytest.approx(41.0 / 3600 * 3.6 * 2, rel=1e-12)
    longer = estimate(tmp_path / "pilot", steps=20, price_per_gpu_hour=3.6, price_per_hour=1.8)
    assert longer.wall_s == 50.0 + 6 * 2.5 + 5 * 1.5 + 5 * 0.5 == 75.0
    assert longer.cost == pytest.approx(75.0 / 3600 * (3.6 * 2 + 1.8), rel=1e-12)


def test_gpu_count_follows_the_placement(tmp_path: Path) -> None:
    base = _config()
    apart = replace(base, cluster=replace(base.cluster, colocate_all=False))
    in_process = replace(base, cluster=ClusterSpec())
    counts = [estimate(_pilot(tmp_path / name, config)).gpus for name, config in
              (("apart", apart), ("inproc", in_process), ("cpu", _config("cpu")))]
    assert counts == [3, 1, 0]
    assert estimate(tmp_path / "cpu", price_per_gpu_hour=9.0).cost == 0.0
    assert estimate(tmp_path / "cpu").cost is None


def test_the_command_prints_a_table_wall_time_cost_and_json(tmp_path: Path, capsys) -> None:
    main(["estimate", str(_pilot(tmp_path / "pilot", _config())), "--price-per-gpu-hour", "3.6"])
    lines = capsys.readouterr().out.splitlines()
    assert "step 1 skipped as warm-up" in lines[0] and lines[1].split()[0] == "phase"
    assert lines[-3] == "wall time: 41.0 s (0.01 h) for 10 steps, start-up not counted"
    assert lines[-2] == "cost: 0.08 at 3.6 per GPU-hour x 2 GPU"
    record = json.loads(lines[-1])
    assert record["wall_s"] == 41.0 and record["steps"] == 10 and len(record["phases"]) == 7


def test_a_folder_that_is_no_run_is_one_line(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", str(tmp_path / "nope")])
    assert exit_info.value.code == 4
    assert capsys.readouterr().err.strip() == \
        f"error: {tmp_path / 'nope'} is not a run folder (no config.json)"
    (tmp_path / "config.json").write_text(json.dumps(to_dict(_config())))
    with pytest.raises(SystemExit):
        main(["estimate", str(tmp_path)])
    assert capsys.readouterr().err.strip() == \
        f"error: {tmp_path}/metrics.jsonl has no step rows: run the pilot for a step"
