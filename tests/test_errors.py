"""Errors a user hits: one line that says what is wrong, and nothing touched on disk."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.config import PRESETS, RunConfig, apply_overrides, to_dict
from workbench.envs import MazeConfig, eval_set
from workbench.envs.tasks import oracle_policy
from workbench.model.load import hub_offline, hub_reachable
from workbench.policy import SamplingParams
from workbench.rl import phases
from workbench.rl.replay import step_list
from workbench.rl.rollout import play_scripted
from workbench.rl.train import train
from workbench.run import read_metrics
from workbench.session import AdamParams, LossConfig, SessionSpec, create_session


def _run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return int(exit_info.value.code), capsys.readouterr().err.strip()


def test_a_missing_model_folder_is_one_line_and_no_run_folder(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    code, err = _run(["train", f"model.name={tmp_path / 'nope'}", f"run_dir={run_dir}"], capsys)
    assert (code, err) == (2, f"config error: model.name: no checkpoint folder {tmp_path / 'nope'}"
                              " (model.name takes tiny, tiny-sft, a checkpoint folder or a hub id"
                              " such as Qwen/Qwen3-VL-8B-Instruct)")
    assert not run_dir.exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        from workbench.model import load_model
        load_model(str(tmp_path / "nope"))


def _closed_port() -> int:
    """A local port nothing listens on (connections to it are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _hub_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a CLI child: an empty Hugging Face cache, no offline variables."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    return env | {"HF_HUB_CACHE": str(tmp_path / "hub"), "OMP_NUM_THREADS": "1"} | extra


def _train_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", "train", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_an_offline_hub_id_that_is_not_cached_is_one_line_and_no_run_folder(tmp_path: Path) -> None:
    run_dir, hub = tmp_path / "run", "nonexistent-org/nonexistent-model"
    done = _train_cli([f"model.name={hub}", f"run_dir={run_dir}"],
                      _hub_env(tmp_path, HF_HUB_OFFLINE="1"))
    assert done.returncode == 2, done.stderr
    # one line, naming the id: no traceback, and no "Retrying in 1s" lines of the hub's backoff
    assert done.stderr == (
        f"config error: model.name: {hub} is neither a checkpoint folder nor in the local "
        f"Hugging Face cache ({tmp_path / 'hub'}), and HF_HUB_OFFLINE is set: point model.name "
        f"at a checkpoint folder, or download {hub} where the hub is reachable\n")
    assert not run_dir.exists()


def test_an_unreachable_hub_is_one_line_without_retries(tmp_path: Path) -> None:
    run_dir, endpoint = tmp_path / "run", f"http://127.0.0.1:{_closed_port()}"
    assert not hub_reachable(endpoint, timeout=2.0)  # refused: one try, no backoff
    done = _train_cli(["model.name=some-org/some-model", f"run_dir={run_dir}"],
                      _hub_env(tmp_path, HF_ENDPOINT=endpoint))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("config error: model.name: some-org/some-model is neither a "
                                  "checkpoint folder nor in the local Hugging Face cache")
    assert done.stderr.endswith(f"and the hub ({endpoint}) could not be reached: point "
                                "model.name at a checkpoint folder, or download it where the "
                                "hub is reachable and set HF_HUB_OFFLINE=1\n")
    assert not run_dir.exists()


def test_a_cached_hub_id_loads_offline_and_without_the_hub(tmp_path: Path, tiny_dir: Path) -> None:
    sha = "0" * 40  # the cache's layout: refs/main names a snapshot folder
    repo = tmp_path / "hub" / "models--some-org--tiny"
    shutil.copytree(tiny_dir, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    script = ("import os, warnings\n"
              "from workbench.model.load import load_model, model_name_problem\n"
              "with warnings.catch_warnings(record=True) as caught:\n"
              "    warnings.simplefilter('always')\n"
              "    assert model_name_problem('some-org/tiny') == ''\n"
              "    load_model('some-org/tiny')\n"
              "print([str(w.message) for w in caught])\n"
              "os.environ['HF_HUB_OFFLINE'] = '1'\n"
              "print(load_model('some-org/tiny').source)\n"
              "print(model_name_problem('some-org/other'))\n")
    env = _hub_env(tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    warned, source, problem = done.stdout.splitlines()
    assert warned == ("['the Hugging Face hub could not be reached: loading some-org/tiny from "
                      "the local cache (set HF_HUB_OFFLINE=1 to skip this check)']")
    assert source == "some-org/tiny" and "HF_HUB_OFFLINE is set" in problem
    assert "Retrying" not in done.stderr


def test_offline_variables_read_as_huggingface_hub_reads_them(monkeypatch) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    assert hub_offline() == ""
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert hub_offline() == "TRANSFORMERS_OFFLINE"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # set: it decides, as in huggingface_hub
    assert hub_offline() == ""
    monkeypatch.setenv("HF_HUB_OFFLINE", "yes")
    assert hub_offline() == "HF_HUB_OFFLINE"


@pytest.mark.parametrize("where", ["first", "last"])
def test_the_adapter_option_may_stand_anywhere(where: str, capsys) -> None:
    overrides = ["model.name=tiny", "env.bogus=1"]  # a bad key: proof the overrides were read
    argv = (["eval", "--adapter", "/nope", *overrides] if where == "first"
            else ["eval", *overrides, "--adapter", "/nope"])
    code, err = _run(argv, capsys)
    assert code == 2 and err.startswith("config error: unknown config key 'env.bogus'")


def test_overrides_may_follow_an_option_and_a_bad_adapter_is_one_line(tmp_path: Path,
                                                                      capsys) -> None:
    code, err = _run(["eval", "model.name=tiny", "--adapter", str(tmp_path / "nope"),
                      "env.size=5"], capsys)  # env.size=5 after --adapter: parsed, not refused
    assert code == 2 and err.startswith(f"config error: adapter {tmp_path / 'nope'}: not an "
                                        "adapter folder") and "\n" not in err
    code, err = _run(["eval", "model.name=tiny", "--bogus"], capsys)
    assert code == 2 and err.endswith("error: unrecognized arguments: --bogus")


def test_a_run_dir_that_is_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("mine\n")
    code, err = _run(["train", "model.name=tiny", f"run_dir={tmp_path / 'file'}"], capsys)
    assert (code, err) == (4, f"error: run_dir {tmp_path / 'file'} is a file, not a folder: "
                              "choose another run_dir")
    assert (tmp_path / "file").read_text() == "mine\n"


def test_replaying_a_step_without_a_record_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(to_dict(RunConfig())))
    (tmp_path / "steps" / "step_000001").mkdir(parents=True)
    (tmp_path / "steps" / "step_000001" / "episodes.json").write_text("[]")
    code, err = _run(["replay", str(tmp_path), "--step", "5"], capsys)
    assert (code, err) == (4, f"error: step 5 is not recorded in {tmp_path}; recorded steps: 1")
    shutil.rmtree(tmp_path / "steps" / "step_000001")
    code, err = _run(["replay", str(tmp_path), "--step", "1"], capsys)
    assert (code, err) == (4, f"error: {tmp_path} has no step records (steps/ is empty: the run "
                              "had trainer.keep_step_records=false, or made no step)")
    code, err = _run(["replay", str(tmp_path / "steps"), "--step", "1"], capsys)
    assert (code, err) == (4, f"error: {tmp_path / 'steps'} is not a run folder (no config.json)")


def test_step_lists_are_short() -> None:
    assert step_list([1, 2]) == "1, 2"
    assert step_list([*range(1, 41), 45, 47, 48]) == "1..40, 45, 47, 48"


def test_phases_name_what_they_take() -> None:
    with pytest.raises(TypeError, match=r"states_P must be initial states .* not ints such as 0"):
        phases.Batch(MazeConfig(size=5), [0, 1], 2, SamplingParams(), 0)
    with pytest.raises(TypeError, match=r"states_P must be initial states .* not MazeConfig"):
        phases.Batch(MazeConfig(size=5), MazeConfig(), 2, SamplingParams(), 0)  # type: ignore
    with pytest.raises(TypeError, match=r"^rollout takes a Batch, not MazeConfig: pass "
                                        r"schedule.step_batch\(config, step\)"):
        phases.rollout(None, MazeConfig(size=5))  # type: ignore[arg-type]
    eps = play_scripted(oracle_policy, MazeConfig(size=5, max_turns=4), eval_set(5, 2), 2)
    record = phases.RolloutRecord(eps, SamplingParams(), 0, 0.0)
    scored = phases.score(record)
    with pytest.raises(TypeError, match=r"not ScoreRecord: pass score\(ro\).rewards_P_G"):
        phases.advantages(scored)  # type: ignore[arg-type]
    assert phases.advantages(scored.rewards_P_G).zero_variance_groups == 2
    adv = phases.advantages(scored.rewards_P_G)
    with pytest.raises(TypeError, match=r"^score takes a RolloutRecord, not list: pass the record"):
        phases.score(eps)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^make_datums takes an AdvantageRecord second, not "
                                        r"ndarray: pass advantages\(score\(ro\).rewards_P_G\)"):
        phases.make_datums(record, scored.rewards_P_G)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^make_datums takes the RolloutRecord first, not "
                                        r"AdvantageRecord: pass ro = rollout"):
        phases.make_datums(adv, record)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^datum_index takes an AdvantageRecord second, not "
                                        "ScoreRecord"):
        phases.datum_index(record, scored)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^update takes datums, a list of Datum, not "
                                        r"RolloutRecord: pass make_datums\(ro, adv\)"):
        phases.update(_NoClient(), record)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"not a list holding Episode: pass make_datums"):
        phases.update(_NoClient(), eps[0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^update takes settings, an UpdateSettings, not str: "
                                        r"pass UpdateSettings\("):
        phases.update(_NoClient(), [], "ppo")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^UpdateSettings takes adam, an AdamParams, not float: "
                                        r"pass AdamParams\(learning_rate=3e-4\)"):
        phases.UpdateSettings("ppo", LossConfig(), 3e-4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^UpdateSettings takes loss, a LossConfig, not str"):
        phases.UpdateSettings("ppo", "ppo", ADAM)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^UpdateSettings takes loss_fn, a loss name such as "
                                        r"\"ppo\", not int"):
        phases.UpdateSettings(0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^update takes a training client first \(session\."
                                        r"training_client\), not list"):
        phases.update([], [])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^evaluate takes a Batch, not MazeConfig: pass "
                                        r"schedule.eval_batch\(config\)"):
        phases.evaluate(None, MazeConfig(size=5))  # type: ignore[arg-type]


ADAM = AdamParams(learning_rate=0.01)


class _NoClient:
    """A training client that must not be called."""

    def forward_backward(self, *args):
        raise AssertionError("forward_backward was called")

    def optim_step(self, *args):
        raise AssertionError("optim_step was called")


def test_an_update_without_datums_warns_and_makes_no_call() -> None:
    with pytest.warns(RuntimeWarning, match=r"^update skipped: 0 datums, so no forward_backward "
                                            "and no optimiser step"):
        up = phases.update(_NoClient(), [], phases.UpdateSettings(adam=ADAM))
    assert (up.datums, up.metrics, up.learning_rate) == (0, {}, 0.01)
    assert repr(up) == "UpdateRecord(skipped: 0 datums, lr 0.01)"


def test_forward_backward_without_datums_warns_and_is_marked_empty(tiny_dir: Path,
                                                                  tmp_path: Path) -> None:
    session = create_session(SessionSpec(str(tiny_dir), workdir=str(tmp_path)))
    try:
        with pytest.warns(RuntimeWarning, match=r"^forward_backward got 0 datums: nothing "
                                                r"computed, no gradient; its output is marked "
                                                r"empty \(out.empty\)"):
            fb = session.training_client.forward_backward([], "ppo")
        out = fb.result()
        assert out.empty and out.metrics["tokens"] == 0 and out.logprobs_B_T == []
        assert repr(out) == "ForwardBackwardOutput(empty: 0 datums, nothing computed, no gradient)"
        assert session.submit(lambda h: [p.grad for p in h.trainable().values()]).result() == [
            None] * len(session.host.trainable())
    finally:
        session.close()


# A short run of the random tiny model: its replies never parse, so every group has zero
# reward variance and no step makes an update.
NO_SIGNAL = ["model.name=tiny", "env.size=7", "generator.max_turns=2", "generator.max_tokens=2",
             "generator.n_samples_per_prompt=2", "trainer.train_batch_size=2", "eval.n_mazes=2",
             "eval.sampled_passes=0", "trainer.total_steps=2", "lora.rank=4", "lora.alpha=8"]


@pytest.fixture(scope="module")
def no_signal_run(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path
                  ) -> tuple[Path, list[str]]:
    run_dir = tmp_path_factory.mktemp("no-signal")
    lines: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the loop says it in its log, no warning
        train(apply_overrides(PRESETS["tiny"], [*NO_SIGNAL, f"run_dir={run_dir}"]),
              log=lines.append)
    return run_dir, lines


def test_steps_without_an_update_log_no_loss_and_say_why_once(no_signal_run) -> None:
    run_dir, lines = no_signal_run
    rows = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    assert [r["update/datums"] for r in rows] == [0, 0], "the random tiny model found signal"
    for row in rows:  # no loss, KL, entropy, clip fraction, token count or grad norm: not 0.0
        assert not {k for k in row if k.startswith("update/")} - {"update/datums",
                                                                  "update/learning_rate"}
    assert [line for line in lines if line.startswith("update skipped")] == [
        "update skipped at step 1: 0 datums, all 2 groups had zero reward variance (every "
        "episode in a group got the same reward), so no optimiser step; later steps like it say "
        "'no update' on their line"]
    assert sum("no update: every group had zero reward variance" in line for line in lines) == 2
    assert lines[-1].startswith("GRPO steps: 2/2 in ") and lines[-1].endswith(" s")


def test_replaying_a_step_out_of_range_names_the_recorded_steps(no_signal_run, capsys) -> None:
    run_dir, _ = no_signal_run
    code, err = _run(["replay", str(run_dir), "--step", "5"], capsys)
    assert (code, err) == (4, f"error: step 5 is not recorded in {run_dir}; recorded steps: 1, 2")


def test_records_print_one_line(tiny) -> None:
    from workbench.policy import chat_format, start_stream
    from workbench.session import datum_from_stream

    eps = play_scripted(oracle_policy, MazeConfig(size=5, max_turns=4), eval_set(5, 2), 2)
    record = phases.RolloutRecord(eps, SamplingParams(temperature=0.7), 3, 1.25)
    assert repr(record) == ("RolloutRecord(P=2 x G=2 episodes, 4 solved, temperature 0.7, "
                            "seed 3, 1.2 s)")
    ep = eps[0][0]
    assert repr(ep).startswith(f"Episode(solved, {ep.turns} turns, reward 1, replies [")
    assert len(repr(ep)) < 200
    stream = start_stream(tiny.processor, chat_format(tiny.processor), "rules")
    assert repr(stream) == f"Stream(T={len(stream)} tokens, 0 sampled, 0 images)"
    datum = datum_from_stream(stream, 1.0)
    assert repr(datum) == f"Datum(T={len(stream)}, 0 weighted tokens, advantages none)"
