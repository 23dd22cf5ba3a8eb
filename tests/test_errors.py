"""Errors a user hits: one line that says what is wrong, and nothing touched on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.cli import main
from workbench.config import RunConfig, to_dict
from workbench.envs import MazeConfig, eval_set
from workbench.policy import SamplingParams
from workbench.rl import phases
from workbench.rl.rollout import oracle_policy, play_scripted


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
    assert (code, err) == (4, f"error: {tmp_path} has no record of step 5 (steps 1..1 in "
                              "steps/; trainer.keep_step_records keeps them)")
    code, err = _run(["replay", str(tmp_path / "steps"), "--step", "1"], capsys)
    assert (code, err) == (4, f"error: {tmp_path / 'steps'} is not a run folder (no config.json)")


def test_phases_name_what_they_take() -> None:
    with pytest.raises(TypeError, match=r"states_P must be initial states .* not ints such as 0"):
        phases.rollout(None, MazeConfig(size=5), [0, 1], 2, SamplingParams(), 0)  # type: ignore
    eps = play_scripted(oracle_policy, MazeConfig(size=5, max_turns=4), eval_set(5, 2), 2)
    record = phases.RolloutRecord(eps, SamplingParams(), 0, 0.0)
    scored = phases.score(record)
    with pytest.raises(TypeError, match=r"not ScoreRecord: pass score\(ro\).rewards_P_G"):
        phases.advantages(scored)  # type: ignore[arg-type]
    assert phases.advantages(scored.rewards_P_G).zero_variance_groups == 2


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
