"""One session spec, one opener: train, replay, eval and SFT open their sessions from the spec a
run of the same config trains with (written to <workdir>/session_spec.json by `open_session`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from workbench.config import PRESETS, apply_overrides
from workbench.opener import read_spec, session_spec
from workbench.session import ClusterSpec, SessionSpec, SpeedSettings

SPEED = ["speed.loss_tokens_only=true", "speed.lora_autocast=true",
         "speed.gradient_checkpointing=true", "speed.selective_checkpointing=true"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path, small_run: list[str]):
    """A 1-step run of the random tiny model with non-default speed settings."""
    from workbench.rl.train import train

    run_dir = tmp_path_factory.mktemp("spec") / "run"
    config = apply_overrides(PRESETS["tiny"], small_run + SPEED + [
        f"model.name={tiny_dir}", f"run_dir={run_dir}", "trainer.total_steps=1",
        "eval.n_mazes=2", "generator.max_turns=2"])
    trainer = train(config, log=lambda *_: None)
    trainer.session.close()
    return config, run_dir


def test_the_spec_carries_every_setting_of_the_config(run) -> None:
    config, run_dir = run
    spec = read_spec(run_dir)
    assert spec == session_spec(config, run_dir)
    assert spec.model == config.model.name and (spec.dtype, spec.device) == ("float32", "cpu")
    assert spec.lora == config.lora
    assert spec.speed == SpeedSettings(gradient_checkpointing=True, selective_checkpointing=True,
                                       loss_tokens_only=True, lora_autocast=True)
    assert spec.engine.max_images == config.generator.max_turns
    assert spec.engine.kv_rows == 3 * 4
    assert spec.cluster == ClusterSpec()


def test_replay_opens_the_run_spec(run) -> None:
    from workbench.rl.replay import replay

    _, run_dir = run
    result = replay(run_dir, 1)
    assert result.exact, (result.logged, result.replayed)
    assert read_spec(run_dir / "replay") == replace(read_spec(run_dir),
                                                    workdir=str(run_dir / "replay"))


def test_eval_opens_the_run_spec_with_the_adapter(run) -> None:
    from workbench.rl.eval_model import evaluate_model

    config, run_dir = run
    adapter = run_dir / "exports" / "global_step_1"
    record = evaluate_model(config, adapter=str(adapter), log=lambda *_: None)
    assert [r.n_mazes for r in record.results] == [2, 2]
    [workdir] = [p for p in run_dir.iterdir() if p.name.startswith("eval-")]
    assert read_spec(workdir) == replace(read_spec(run_dir), workdir=str(workdir))


def test_sft_opens_the_run_spec_without_engines(run, tmp_path: Path) -> None:
    from workbench.rl.sft import run_sft

    config, run_dir = run
    sft = replace(config, run_dir=str(tmp_path / "sft"),
                  sft=replace(config.sft, steps=1, batch_size=1, full_finetune=False))
    run_sft(sft, log=lambda *_: None)
    train_spec = read_spec(run_dir)
    assert read_spec(tmp_path / "sft") == replace(
        train_spec, workdir=str(tmp_path / "sft"),
        cluster=replace(train_spec.cluster, num_engines=0))


def test_a_spec_round_trips_through_its_file(tmp_path: Path) -> None:
    from workbench.model import LoraSettings
    from workbench.opener import write_spec
    from workbench.policy.engine import EngineSettings

    spec = SessionSpec("tiny", LoraSettings(rank=8, alpha=16, vision=True), str(tmp_path),
                       "bfloat16", "cuda",
                       EngineSettings("vllm", 0.3, max_images=9, cuda_graphs=True,
                                      compile_decode=True),
                       SpeedSettings(compile_layers=True),
                       ClusterSpec("ray://127.0.0.1:10001", num_workers=2, strategy="fsdp"))
    write_spec(spec)
    assert read_spec(tmp_path) == spec
    assert read_spec(tmp_path).lora.target_modules == spec.lora.target_modules  # tuples back
    no_lora = replace(spec, lora=None)
    write_spec(no_lora)
    assert read_spec(tmp_path) == no_lora
