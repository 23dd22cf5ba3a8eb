"""The GRPO loop end to end: learning, exact resume after a killed process, replay.

The pretrained tiny policy (conftest.py: tiny-sft, built once per session, about 5 minutes)
is the base, so rollouts carry reward signal and updates are not trivially empty.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import place_run, run_folder, run_overrides
from safetensors.torch import load_file

from workbench import storage
from workbench.config import PRESETS, apply_overrides
from workbench.rl.replay import replay
from workbench.run import read_metrics
from workbench.runfolder import find_checkpoint
from workbench.storage import Store

SMALL = [  # conftest's SMALL_RUN
    "env.size=7", "generator.max_turns=10", "generator.max_tokens=2",
    "generator.n_samples_per_prompt=4", "trainer.train_batch_size=3", "lora.rank=4",
    "lora.alpha=8", "eval.n_mazes=8", "eval.sampled_passes=1", "algorithm.minibatch=8",
    "env.format_weight=0.5",
]


def _overrides(base: str, run_dir: Path, extra: list[str]) -> list[str]:
    return SMALL + [f"model.name={base}", f"run_dir={run_dir}"] + extra


def _train_cli(overrides: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "workbench", "train", *overrides], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _env() -> dict:
    return os.environ | {"OMP_NUM_THREADS": "1", "WORKBENCH_CACHE": os.environ["WORKBENCH_CACHE"]}


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


RESUME = ["trainer.total_steps=4", "trainer.ckpt_interval=2", "trainer.eval_interval=2",
          "trainer.hf_save_interval=4", "algorithm.learning_rate=1e-3"]


@pytest.fixture(scope="session")
def straight_run(sft_model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run that nobody interrupts."""
    run_dir = tmp_path_factory.mktemp("straight")
    proc = _train_cli(_overrides(sft_model, run_dir, RESUME + ["trainer.resume_mode=none"]), _env())
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return run_dir


def test_killed_run_resumes_to_identical_metrics(straight_run: Path, sft_model: str,
                                                 store: Store, tmp_path: Path) -> None:
    """SIGKILL after the step-2 checkpoint (on S3: once it is uploaded), then the same command
    ends as the straight run. On S3 the resume starts from a new working copy: S3 alone."""
    def command(at: Path) -> list[str]:
        return SMALL + [f"model.name={sft_model}", *run_overrides(store, at), *RESUME,
                        "trainer.resume_mode=latest"]

    proc = _train_cli(command(tmp_path / "killed"), _env())
    deadline = time.monotonic() + 600
    while not storage.folder_complete(store, "checkpoints/global_step_2") and \
            proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for an event (the checkpoint), not for time to pass
    assert storage.folder_complete(store, "checkpoints/global_step_2"), "no step-2 checkpoint"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = run_folder(store, tmp_path / "killed").local
    assert not (killed / "exports" / "global_step_4").exists(), "killed too late to test"
    resumed = _train_cli(command(tmp_path / "again"), _env())
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    [resumed_line] = [line for line in out.splitlines() if line.startswith("resumed from")]
    assert resumed_line.endswith("at step 2"), out  # (a line on leftovers of the kill may precede)
    again = run_folder(store, tmp_path / "again").local
    straight, rows = read_metrics(straight_run), read_metrics(again)
    assert [r["step"] for r in rows] == [r["step"] for r in straight]
    assert _comparable(rows) == _comparable(straight)
    a = load_file(str(straight_run / "exports/global_step_4/adapter_model.safetensors"))
    b = load_file(str(again / "exports/global_step_4/adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_training_changed_lora_and_used_signal(straight_run: Path) -> None:
    rows = [r for r in read_metrics(straight_run) if "reward/mean" in r]
    assert len(rows) == 4
    assert sum(r["update/datums"] for r in rows) > 0, "no group carried reward signal"
    a = load_file(str(straight_run / "checkpoints/global_step_0/state/adapter_model.safetensors"))
    b = load_file(str(straight_run / "exports/global_step_4/adapter_model.safetensors"))
    changed = [k for k in a if "lora_B" in k and not torch.equal(a[k], b[k])]
    assert changed, "no LoRA B matrix moved"
    manifest = json.loads((straight_run / "manifest.json").read_text())
    assert manifest["model"]["base_weights_sha256"] and manifest["reward_source_sha256"]


@pytest.mark.parametrize("step", [2, 3])
def test_replay_reproduces_logged_update(straight_run: Path, step: int) -> None:
    result = replay(straight_run, step)
    assert result.from_checkpoint == (0 if step == 2 else 2)  # step 2 re-runs step 1 first
    assert result.replayed == result.logged
    assert result.exact


def test_truncated_checkpoint_is_skipped(straight_run: Path, store: Store, tmp_path: Path) -> None:
    folder = place_run(straight_run, store, tmp_path)
    storage.delete(store, "checkpoints/global_step_4/COMPLETE")  # as if killed mid-write
    storage.write_bytes(store, "latest_checkpointed_iteration.txt", b"4\n")
    messages: list[str] = []
    assert find_checkpoint(folder, messages.append).name == "global_step_2"
    assert "incomplete" in messages[0]


def test_grpo_improves_success_on_a_fixed_set(sft_model: str, tmp_path: Path) -> None:
    """The demo's recipe (LoRA 32 with the vision tower, lr 3e-4, GiGPO step advantages, 8 mazes
    x 8 samples, 15 turns) for 10 steps from tiny-sft: held-out greedy success rises by at least
    3 of 16 mazes (9 -> 13 with these seeds), sampled does not fall."""
    from workbench.rl.train import train

    config = apply_overrides(PRESETS["tiny"], _overrides(sft_model, tmp_path / "e2e", [
        "env.format_weight=0.0", "eval.n_mazes=16", "eval.sampled_passes=2",
        "generator.n_samples_per_prompt=8", "trainer.train_batch_size=8",
        "generator.max_turns=15", "lora.rank=32", "lora.alpha=64",
        "trainer.total_steps=10", "algorithm.learning_rate=3e-4", "algorithm.step_advantage=1.0",
        "algorithm.loss_reduction=sequence_mean", "trainer.eval_interval=5",
        "trainer.ckpt_interval=0", "trainer.hf_save_interval=0", "trainer.resume_mode=none"]))
    train(config, log=lambda *_: None)
    evals = [r for r in read_metrics(tmp_path / "e2e") if "eval/greedy_solved" in r]
    assert [r["step"] for r in evals] == [0, 5, 10]
    assert evals[-1]["eval/greedy_solved"] >= evals[0]["eval/greedy_solved"] + 3, evals
    assert evals[-1]["eval/sampled_solved"] >= evals[0]["eval/sampled_solved"], evals


def test_speed_settings_keep_the_update(straight_run: Path, sft_model: str,
                                        tmp_path: Path) -> None:
    """speed.gradient_checkpointing (selective), speed.compile_layers,
    speed.loss_tokens_only and speed.lora_autocast (a no-op on this float32 model) change
    how the update is computed, not what it is: step 1 matches the plain run (same rollout, same
    loss, grads)."""
    extra = RESUME + ["trainer.total_steps=1", "trainer.resume_mode=none",
                      "speed.gradient_checkpointing=true",
                      "speed.selective_checkpointing=true", "speed.compile_layers=true",
                      "speed.loss_tokens_only=true", "speed.lora_autocast=true"]
    config = apply_overrides(PRESETS["tiny"], _overrides(sft_model, tmp_path, extra))
    trainer = _train_one_thread(config)
    host = trainer.session.host
    assert host.speed.loss_tokens_only and host.speed.lora_autocast
    assert host.lm.model.is_gradient_checkpointing
    layers = host.lm.model.get_base_model().model.language_model.layers
    assert all(layer.compiled_for_training for layer in layers)
    _assert_first_step_equals(tmp_path, straight_run)


def _train_one_thread(config):
    """train(config) on one torch thread, as the CLI run of straight_run (OMP_NUM_THREADS=1)."""
    from workbench.rl.train import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(config, log=lambda *_: None)
    finally:
        torch.set_num_threads(threads)


def _assert_first_step_equals(run_dir: Path, straight_run: Path) -> None:
    """Step 1 of run_dir logged what the straight run's step 1 did: the update's metrics to
    float rounding, everything else exactly."""
    [got] = [r for r in read_metrics(run_dir) if r["step"] == 1 and "reward/mean" in r]
    [plain] = [r for r in read_metrics(straight_run) if r["step"] == 1 and "reward/mean" in r]
    assert got["update/datums"] > 0
    for key, value in _comparable([plain])[0].items():
        if key.startswith("update/"):
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        else:
            assert got[key] == value, key


OFF_POLICY = RESUME + ["algorithm.off_policy_steps=1"]


def test_off_policy_samples_ahead_and_resumes_exactly(sft_model: str, tmp_path: Path) -> None:
    """algorithm.off_policy_steps=1: step 2's rollout is exactly the one the step-0 weights make
    for step 2's mazes and seed (it was sampled ahead, beside step 1's update, which changed the
    weights); the step after a checkpoint samples on-policy again (lags 0, 1, 0, 1 with a
    checkpoint every 2 steps); and a run stopped at its step-2 checkpoint resumes to the metrics
    of one that ran straight through."""
    from workbench.opener import session_spec
    from workbench.rl import phases
    from workbench.rl.schedule import step_batch
    from workbench.rl.train import train
    from workbench.session.inprocess import create_session_from_state

    lines: list[str] = []

    def run(folder: str, extra: list[str]) -> Path:
        config = apply_overrides(PRESETS["tiny"], _overrides(sft_model, tmp_path / folder,
                                                             OFF_POLICY + extra))
        train(config, log=lines.append)
        return tmp_path / folder

    straight = run("straight", ["trainer.resume_mode=none"])
    [told] = [x for x in lines if x.startswith("algorithm.off_policy_steps=1")]  # once a run
    assert "engine.name=transformers in-process" in told and "no overlap" in told
    run("stopped", ["trainer.resume_mode=none", "trainer.total_steps=2"])
    resumed = run("stopped", ["trainer.resume_mode=latest"])
    rows = [r for r in read_metrics(straight) if "reward/mean" in r]
    assert [r["rollout/policy_lag"] for r in rows] == [0, 1, 0, 1]
    assert rows[0]["update/datums"] > 0  # step 1 moved the weights: step 2 sampled the old ones
    assert _comparable(read_metrics(resumed)) == _comparable(read_metrics(straight))

    config = apply_overrides(PRESETS["tiny"], _overrides(sft_model, straight, OFF_POLICY))
    state = straight / "checkpoints" / "global_step_0" / "state"
    session = create_session_from_state(state, spec=session_spec(config, tmp_path / "v0"))
    try:
        sampler = session.training_client.save_weights_and_get_sampling_client()
        ro = phases.rollout(sampler, step_batch(config, 2))  # step 2's, from step 0's weights
    finally:
        session.close()
    assert phases.score(ro).rewards_P_G.mean() == rows[1]["reward/mean"]
    assert ro.reply_entropy() == rows[1]["rollout/entropy"]  # the sampler's own log-probs


def test_off_policy_starts_the_next_rollout_before_the_update(sft_model: str,
                                                              tmp_path: Path) -> None:
    """The loop hands the session step 2's rollout before step 1's forward_backward, so on Ray
    the engines sample it while the trainers update; the last step starts none."""
    from workbench.rl.schedule import step_seed
    from workbench.rl.train import start, train_step

    config = apply_overrides(PRESETS["tiny"], _overrides(sft_model, tmp_path, OFF_POLICY + [
        "trainer.total_steps=2", "trainer.ckpt_interval=0", "trainer.resume_mode=none"]))
    trainer = start(config, log=lambda *_: None)
    calls: list[str] = []
    tc = trainer.session.training_client
    forward_backward, save = tc.forward_backward, tc.save_weights_and_get_sampling_client

    def spy_forward_backward(*args: object, **kwargs: object) -> object:
        calls.append("forward_backward")
        return forward_backward(*args, **kwargs)

    def spy_save() -> object:
        sampler = save()
        play = sampler.play

        def spy_play(loop: object, task: object, states: object, n: int, params: object,
                     seed: int) -> object:
            calls.append(f"play seed {seed}")
            return play(loop, task, states, n, params, seed)
        sampler.play = spy_play  # type: ignore[method-assign]
        return sampler

    tc.forward_backward = spy_forward_backward  # type: ignore[method-assign]
    tc.save_weights_and_get_sampling_client = spy_save  # type: ignore[method-assign]
    try:
        rows = [train_step(trainer), train_step(trainer)]
    finally:
        trainer.session.close()
    first_update = calls.index("forward_backward")
    assert calls[:first_update] == [f"play seed {step_seed(config, s)}" for s in (1, 2)], calls
    assert len([c for c in calls if c.startswith("play")]) == 2, calls
    assert trainer.ahead is None
    assert [r["rollout/policy_lag"] for r in rows] == [0, 1]


def test_off_policy_step_ignores_a_rollout_started_for_another_step(sft_model: str,
                                                                    tmp_path: Path) -> None:
    """A rollout left ahead by an interrupted notebook cell belongs to another step (its seed
    says which): the step samples its own instead of training on other mazes."""
    from workbench.policy import SamplingParams
    from workbench.rl import phases
    from workbench.rl.schedule import step_mazes, step_seed
    from workbench.rl.train import start, train_step

    config = apply_overrides(PRESETS["tiny"], _overrides(sft_model, tmp_path, OFF_POLICY + [
        "trainer.total_steps=1", "trainer.ckpt_interval=0", "trainer.resume_mode=none"]))
    trainer = start(config, log=lambda *_: None)
    try:
        sampler = trainer.training_client.save_weights_and_get_sampling_client()
        trainer.ahead = phases.start_rollout(sampler, phases.Batch(
            config.task, step_mazes(config, 2), config.generator.n_samples_per_prompt,
            SamplingParams(max_tokens=2), step_seed(config, 2)))
        row = train_step(trainer)
    finally:
        trainer.session.close()
    assert row["rollout/policy_lag"] == 0 and trainer.ahead is None


def test_share_prefix_keeps_the_update(straight_run: Path, sft_model: str,
                                       tmp_path: Path) -> None:
    """speed.share_prefix runs each maze's first prompt once in the update: step 1 matches
    the plain run (same rollout, the same loss and grad norm to 1e-4)."""
    extra = RESUME + ["trainer.total_steps=1", "trainer.resume_mode=none",
                      "speed.share_prefix=true"]
    config = apply_overrides(PRESETS["tiny"], _overrides(sft_model, tmp_path, extra))
    trainer = _train_one_thread(config)
    assert trainer.session.host.speed.share_prefix
    _assert_first_step_equals(tmp_path, straight_run)


def test_dynamic_sampling_replaces_the_groups_without_signal(sft_model: str,
                                                             tmp_path: Path) -> None:
    """algorithm.dynamic_sampling=2 (DAPO): the step's groups that carry signal are those of the
    plain step, and each flat group is replaced by a refill maze's group (refill_mazes), so the
    update gets more datums; the metrics count every group sampled."""
    from workbench.rl.schedule import refill_mazes
    from workbench.rl.train import start, train_step

    base = ["env.size=9", "env.format_weight=0.0", "generator.max_turns=15",
            "trainer.total_steps=1", "trainer.eval_interval=0", "trainer.ckpt_interval=0",
            "trainer.hf_save_interval=0", "trainer.resume_mode=none"]
    rows, records = [], []
    for name, extra in (("plain", []), ("dynamic", ["algorithm.dynamic_sampling=2"])):
        config = apply_overrides(PRESETS["tiny"],
                                 _overrides(sft_model, tmp_path / name, base + extra))
        trainer = start(config, log=lambda *_: None)
        try:
            rows.append(train_step(trainer))
        finally:
            trainer.session.close()
        records.append(json.loads((tmp_path / name / "steps" / "step_000001" /
                                   "episodes.json").read_text()))
    plain, dynamic = rows
    P = 3
    flat = [p for p in range(P) if p not in {p for p, _ in records[0]["datum_index"]}]
    assert flat and plain["rollout/groups_sampled"] == P
    assert dynamic["rollout/groups_sampled"] > P
    assert dynamic["update/datums"] > plain["update/datums"]
    for p in range(P):
        same = records[1]["episodes_P_G"][p] == records[0]["episodes_P_G"][p]
        assert same == (p not in flat), p
    refills = {s.maze_seed for r in (1, 2) for s in refill_mazes(config, 1, r, P)}
    assert {records[1]["episodes_P_G"][p][0]["init_state"]["maze_seed"] for p in flat} <= refills
