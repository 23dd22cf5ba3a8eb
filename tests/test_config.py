"""Run configuration: dotted overrides, validation messages, presets, round trips, the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from workbench.config import (
    CHOICES,
    PRESETS,
    ConfigError,
    RunConfig,
    apply_overrides,
    describe_keys,
    field_docs,
    flat_keys,
    from_dict,
    to_dict,
)
from workbench.envs import MazeConfig

SECTIONS = ("model", "lora", "env", "generator", "engine", "trainer", "algorithm", "speed",
            "eval", "sft", "cluster", "storage")

# ------------------------------------------------------------------------- overrides


def test_overrides_set_nested_values_with_their_types() -> None:
    cfg = apply_overrides(RunConfig(), [
        "generator.max_turns=10",  # int
        "algorithm.learning_rate=1e-3",  # float
        "eval.greedy=false",  # bool
        "sft.full_finetune=TRUE",  # bool, any case
        "model.name=runs/sft/model",  # str
        "env.format_weight=0.2",
        "run_dir=runs/x",  # a top-level key
    ])
    assert cfg.generator.max_turns == 10 and type(cfg.generator.max_turns) is int
    assert cfg.algorithm.learning_rate == 1e-3 and type(cfg.algorithm.learning_rate) is float
    assert cfg.eval.greedy is False
    assert cfg.sft.full_finetune is True
    assert cfg.model.name == "runs/sft/model"
    assert cfg.env.format_weight == 0.2
    assert cfg.run_dir == "runs/x"
    # everything else keeps its default
    changed = {"generator.max_turns", "algorithm.learning_rate", "eval.greedy",
               "sft.full_finetune", "model.name", "env.format_weight", "run_dir"}
    before, after = flat_keys(RunConfig()), flat_keys(cfg)
    assert {k for k in before if before[k] != after[k]} == changed - {"sft.full_finetune"}


def test_overrides_leave_the_input_untouched_and_apply_in_order() -> None:
    base = RunConfig()
    cfg = apply_overrides(base, ["lora.rank=8", "lora.rank=16", "--lora.alpha=4"])
    assert (cfg.lora.rank, cfg.lora.alpha) == (16, 4)
    assert base == RunConfig()
    assert apply_overrides(base, []) == base


@pytest.mark.parametrize("raw,expected", [("true", True), ("false", False), ("1", True),
                                          ("0", False), ("False", False)])
def test_bool_coercion(raw: str, expected: bool) -> None:
    assert apply_overrides(RunConfig(), [f"eval.greedy={raw}"]).eval.greedy is expected


def test_bool_rejects_other_words() -> None:
    with pytest.raises(ConfigError, match="eval.greedy"):
        apply_overrides(RunConfig(), ["eval.greedy=yes"])


def test_unknown_key_names_close_match_and_section_keys() -> None:
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), ["generator.max_turn=3"])
    msg = str(err.value)
    assert "generator.max_turn" in msg
    assert "did you mean generator.max_turns" in msg
    for name in (f.name for f in dataclasses.fields(RunConfig().generator)):
        assert f"generator.{name}" in msg
    assert "trainer.total_steps" not in msg  # only the section's keys are listed


def test_unknown_section_lists_every_key() -> None:
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), ["nosuch.thing=1"])
    for key in flat_keys(RunConfig()):
        assert key in str(err.value)


def test_override_without_equals_sign_is_rejected() -> None:
    with pytest.raises(ConfigError, match="section.key=value"):
        apply_overrides(RunConfig(), ["trainer.total_steps"])


def test_bad_choice_names_the_closest_choice() -> None:
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), ["algorithm.loss=ppx"])
    msg = str(err.value)
    assert "algorithm.loss" in msg and "'ppo'" in msg and "ppx" in msg


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_every_choice_is_accepted_and_others_rejected(key: str) -> None:
    for value in CHOICES[key]:
        needs = {"from_path": ["trainer.resume_path=some/dir"], "fsdp": ["model.device=cuda"]}
        extra = needs.get(value, [])
        cfg = apply_overrides(RunConfig(), [f"{key}={value}", *extra])
        assert flat_keys(cfg)[key] == value
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        apply_overrides(RunConfig(), [f"{key}=not_a_choice"])


def test_wrong_type_names_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        apply_overrides(RunConfig(), ["trainer.total_steps=abc"])
    msg = str(err.value)
    assert "trainer.total_steps" in msg and "int" in msg and "abc" in msg


def test_float_for_int_is_rejected() -> None:
    with pytest.raises(ConfigError, match="lora.rank"):
        apply_overrides(RunConfig(), ["lora.rank=3.5"])


def test_one_sample_per_prompt_is_rejected() -> None:
    with pytest.raises(ConfigError, match="n_samples_per_prompt"):
        apply_overrides(RunConfig(), ["generator.n_samples_per_prompt=1"])
    assert apply_overrides(RunConfig(), ["generator.n_samples_per_prompt=2"]) \
        .generator.n_samples_per_prompt == 2


def test_fp8_vllm_without_vllm_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"engine\.vllm_fp8 .* engine\.name=vllm"):
        apply_overrides(RunConfig(), ["engine.vllm_fp8=true"])
    config = apply_overrides(RunConfig(), ["engine.name=vllm", "engine.vllm_fp8=true"])
    assert config.engine.vllm_fp8 is True


@pytest.mark.parametrize("key", ["generator.max_turns", "generator.max_tokens",
                                 "trainer.train_batch_size", "algorithm.minibatch",
                                 "eval.n_mazes", "lora.rank"])
def test_non_positive_counts_are_rejected(key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        apply_overrides(RunConfig(), [f"{key}=0"])


def test_resume_from_path_needs_a_path() -> None:
    with pytest.raises(ConfigError, match="resume_path"):
        apply_overrides(RunConfig(), ["trainer.resume_mode=from_path"])
    cfg = apply_overrides(RunConfig(), ["trainer.resume_mode=from_path",
                                        "trainer.resume_path=runs/x/checkpoints/step_4"])
    assert cfg.trainer.resume_path == "runs/x/checkpoints/step_4"


def test_bad_env_values_surface_as_config_errors() -> None:
    with pytest.raises(ConfigError, match="env"):
        apply_overrides(RunConfig(), ["env.format_weight=1.5"])


# ---------------------------------------------------------------- presets, round trips


@pytest.mark.parametrize("name", ["tiny", "seed_gpu"])
def test_dict_round_trip(name: str) -> None:
    cfg = PRESETS[name]
    data = to_dict(cfg)
    assert json.loads(json.dumps(data)) == data  # JSON-ready
    assert from_dict(data) == cfg
    assert from_dict(json.loads(json.dumps(data))) == cfg


def test_dict_round_trip_of_changed_values() -> None:
    cfg = apply_overrides(PRESETS["seed_gpu"], [
        "trainer.resume_mode=from_path", "trainer.resume_path=runs/a b/ckpt",
        "eval.greedy=false", "algorithm.learning_rate=2.5e-06", "run_dir=runs/elsewhere"])
    assert from_dict(to_dict(cfg)) == cfg


def test_from_dict_rejects_unknown_keys() -> None:
    data = to_dict(RunConfig())
    data["trainer"]["total_step"] = 3
    with pytest.raises(ConfigError, match="total_steps"):
        from_dict(data)


def test_tiny_preset_is_the_default() -> None:
    assert PRESETS["tiny"] == RunConfig()


def test_task_takes_the_generators_turn_budget() -> None:
    cfg = RunConfig()
    assert cfg.env.task == "maze"
    assert cfg.task == MazeConfig(size=9, px_per_cell=16, grammar="keyword", max_turns=15,
                                  reward="reach_goal", format_weight=0.0, observation="image")
    assert cfg.task.max_turns == cfg.generator.max_turns
    assert apply_overrides(cfg, ["generator.max_turns=6"]).task.max_turns == 6


def test_seed_gpu_preset_holds_the_seed_recipe() -> None:
    cfg = PRESETS["seed_gpu"]
    assert cfg.model.name == "Qwen/Qwen3-VL-8B-Instruct"
    assert (cfg.lora.rank, cfg.lora.alpha) == (32, 64)
    assert cfg.generator.n_samples_per_prompt == 8
    assert cfg.generator.max_turns == 15 and cfg.task.max_turns == 15
    assert cfg.generator.temperature == 0.7
    assert (cfg.trainer.ckpt_interval, cfg.trainer.hf_save_interval) == (20, 20)
    assert cfg.trainer.eval_interval == 10
    assert cfg.eval.n_mazes == 64
    assert cfg.env.size == 9 and cfg.task.size == 9
    assert (cfg.env.px_per_cell, cfg.env.grammar, cfg.env.reward) == (25, "tuple", "stop_on_goal")
    assert cfg.env.format_weight == 0.2  # reward 0.8 task + 0.2 format
    assert cfg.sft.full_finetune is False
    # the 8B shape on one H200 (benchmarks/RESULTS.md: run 8, side by side)
    assert cfg.engine.name == "vllm" and cfg.engine.gpu_memory_utilization == 0.3
    assert cfg.speed.loss_tokens_only and cfg.speed.lora_autocast
    assert cfg.speed.compile_layers and not cfg.speed.gradient_checkpointing
    assert cfg.algorithm.minibatch == 4
    assert cfg.engine.cuda_graphs and cfg.engine.fused_decode
    assert cfg.engine.compile_decode


# ------------------------------------------------------------------------- help text


@pytest.mark.parametrize("section", SECTIONS)
def test_every_field_has_a_docstring(section: str) -> None:
    cls = type(getattr(RunConfig(), section))
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        assert docs.get(f.name, "").strip(), f"{section}.{f.name} has no docstring"


def test_describe_keys_lists_every_key_with_default_and_help() -> None:
    cfg = RunConfig()
    lines = describe_keys(cfg).splitlines()
    keys = flat_keys(cfg)
    assert len(lines) == len(keys)
    by_key = {line.split("=", 1)[0].strip(): line for line in lines}
    assert set(by_key) == set(keys)
    for section in SECTIONS:
        sub = getattr(cfg, section)
        docs = field_docs(type(sub))
        for f in dataclasses.fields(sub):
            line = by_key[f"{section}.{f.name}"]
            assert line.strip().startswith(f"{section}.{f.name}={getattr(sub, f.name)}")
            assert docs[f.name] in line


# ------------------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_cli_train_help_lists_the_keys() -> None:
    out = _cli("train", "--help")
    assert out.returncode == 0, out.stderr
    assert "generator.n_samples_per_prompt" in out.stdout
    assert "trainer.resume_mode" in out.stdout


def test_cli_unknown_key_exits_2_with_a_hint() -> None:
    out = _cli("train", "generator.max_turn=3")
    assert out.returncode == 2
    assert "did you mean" in out.stderr
    assert "generator.max_turns" in out.stderr
    assert "Traceback" not in out.stderr


SKYRL_KEYS = {  # SkyRL's spelling=value -> the key it sets here and the value it holds
    "trainer.placement.colocate_all=false": ("cluster.colocate_all", False),
    "trainer.placement.policy_num_gpus_per_node=2": ("cluster.num_workers", 2),
    "generator.num_inference_engines=3": ("cluster.num_engines", 3),
    "generator.backend=vllm": ("engine.name", "vllm"),
    "generator.gpu_memory_utilization=0.45": ("engine.gpu_memory_utilization", 0.45),
    "trainer.algorithm.advantage_estimator=rloo": ("algorithm.advantage", "rloo"),
    "trainer.algorithm.loss_reduction=token_mean": ("algorithm.loss_reduction", "token_mean"),
    "trainer.algorithm.eps_clip_low=0.1": ("algorithm.clip_low", 0.1),
    "trainer.algorithm.eps_clip_high=0.28": ("algorithm.clip_high", 0.28),
    "trainer.policy.optimizer_config.lr=3e-6": ("algorithm.learning_rate", 3e-6),
    "trainer.policy.optimizer_config.max_grad_norm=0.5": ("algorithm.grad_clip_norm", 0.5),
    "trainer.update_epochs_per_batch=2": ("algorithm.update_epochs", 2),
    "trainer.gradient_checkpointing=true": ("speed.gradient_checkpointing", True),
    "trainer.fp8_base=true": ("speed.fp8_base", True),
    "trainer.algorithm.tis_imp_ratio_cap=2.0": ("algorithm.tis_cap", 2.0),
    # the keys the seed quotes are this config's own
    "generator.n_samples_per_prompt=8": ("generator.n_samples_per_prompt", 8),
    "generator.max_turns=15": ("generator.max_turns", 15),
    "trainer.ckpt_interval=20": ("trainer.ckpt_interval", 20),
    "trainer.resume_mode=latest": ("trainer.resume_mode", "latest"),
    "trainer.hf_save_interval=20": ("trainer.hf_save_interval", 20),
    "trainer.eval_interval=10": ("trainer.eval_interval", 10),
}


@pytest.mark.parametrize("override", sorted(SKYRL_KEYS))
def test_skyrl_keys_are_accepted_verbatim(override: str) -> None:
    key, value = SKYRL_KEYS[override]
    assert flat_keys(apply_overrides(PRESETS["tiny"], [override]))[key] == value


OLD_KEYS = {
    "speed.cuda_graphs=false": ("engine.cuda_graphs", False),
    "speed.gqa_decode=false": ("engine.gqa_decode", False),
    "speed.kv_rows=32": ("engine.kv_rows", 32),
    "speed.kv_tokens=1024": ("engine.kv_tokens", 1024),
    "speed.bucket=128": ("engine.bucket", 128),
    "speed.fused_decode=false": ("engine.fused_decode", False),
    "speed.compile_decode=true": ("engine.compile_decode", True),
}
"""The sampler's knobs under their earlier `speed.*` names: now the engine's."""


@pytest.mark.parametrize("override", sorted(OLD_KEYS))
def test_the_samplers_knobs_keep_their_earlier_speed_names(override: str) -> None:
    key, value = OLD_KEYS[override]
    assert flat_keys(apply_overrides(PRESETS["tiny"], [override]))[key] == value


def test_a_saved_config_with_the_knobs_under_speed_reads_back_under_engine() -> None:
    from workbench.config import from_dict, to_dict

    config = apply_overrides(PRESETS["seed_gpu"], ["engine.kv_rows=48"])
    old = to_dict(config)
    old["speed"] |= {k: old["engine"].pop(k) for k in ("cuda_graphs", "kv_rows", "bucket")}
    assert from_dict(old) == config


def test_skyrl_aliases_all_have_a_test() -> None:
    from workbench.config import ALIASES

    assert set(ALIASES) <= {o.split("=")[0] for o in SKYRL_KEYS | OLD_KEYS}


def test_each_knob_is_declared_once_by_the_record_a_session_is_opened_with() -> None:
    """The lora, engine, speed and cluster sections are the session's own records, so a key's
    default and help line come from one declaration."""
    from workbench.model.lora import LoraSettings
    from workbench.policy.engine import EngineSettings
    from workbench.session.spec import ClusterSpec, SpeedSettings

    config = RunConfig()
    for name, record in (("lora", LoraSettings), ("engine", EngineSettings),
                         ("speed", SpeedSettings), ("cluster", ClusterSpec)):
        assert type(getattr(config, name)) is record
        docs = field_docs(record)
        assert set(docs) == {f.name for f in dataclasses.fields(record)}  # every knob has help
        help_lines = [line for line in describe_keys(config).splitlines()
                      if line.startswith(f"  {name}.")]
        assert len(help_lines) == len(docs)
        assert all(docs[line.split("=")[0].split(".")[1]] in line for line in help_lines)


def test_a_session_spec_is_the_config_sections_with_what_the_run_fills_in(tmp_path) -> None:
    from workbench.opener import read_spec, session_spec, write_spec

    config = apply_overrides(PRESETS["tiny"], ["trainer.train_batch_size=3", "engine.kv_rows=0",
                                               "lora.target_modules=q_proj,v_proj"])
    spec = session_spec(config, tmp_path)
    assert spec.lora == config.lora and spec.lora.target_modules == ("q_proj", "v_proj")
    assert spec.cluster is config.cluster
    assert spec.engine.kv_rows == 3 * 8 and spec.engine.max_images == 15
    assert spec.engine.cuda_graphs  # the run's setting; the host builds graphs on CUDA only
    write_spec(spec)
    assert read_spec(tmp_path) == spec


def test_notebook_config_switches_the_recipe_by_its_parameters() -> None:
    """PRESET, DEVICE and OVERRIDES of a notebook's parameters cell: the notebook's tuning of
    the tiny preset is not carried into the seed's recipe; None leaves the preset's value;
    OVERRIDES win; a bad preset names the valid ones."""
    from workbench.notebook import NOTEBOOK_TUNING, notebook_config

    sizes = ["trainer.train_batch_size=2", "algorithm.learning_rate=None"]
    tiny = notebook_config(sizes, "", "runs/x")
    assert tiny == apply_overrides(PRESETS["tiny"], [*NOTEBOOK_TUNING["tiny"], sizes[0],
                                                     "run_dir=runs/x"])
    assert (tiny.generator.max_tokens, tiny.lora.rank, tiny.algorithm.learning_rate) == (2, 8, 1e-3)
    seed = notebook_config(sizes, "", "runs/y", "seed_gpu")
    assert (seed.generator.max_tokens, seed.lora.rank) == (32, 32)
    assert seed.algorithm.learning_rate == 1e-5
    assert (seed.model.device, seed.model.dtype, seed.engine.name) == ("cuda", "bfloat16", "vllm")
    assert seed.trainer.train_batch_size == 2 and seed.run_dir == "runs/y"
    gpu_tiny = notebook_config(sizes, "", "", "tiny", "cuda",
                               ["model.dtype=bfloat16", "engine.name=vllm", "lora.rank=4"])
    assert (gpu_tiny.model.device, gpu_tiny.model.dtype, gpu_tiny.engine.name) == (
        "cuda", "bfloat16", "vllm")
    assert gpu_tiny.lora.rank == 4  # OVERRIDES come after the notebook's tuning
    choices = r"unknown preset 'seed'; choose one of \['seed_gpu', 'tiny'\]"
    with pytest.raises(ConfigError, match=choices):
        notebook_config(sizes, preset_name="seed")


def test_truncated_importance_sampling_needs_a_cap_of_one_or_more_and_one_optimiser_step(
        ) -> None:
    """algorithm.tis_cap: 0 is off, a cap below 1 would down-weight every token, and the
    trainer's own log-probs come from the update's one forward, so more optimiser steps per
    rollout are refused, each in one line naming the keys."""
    assert apply_overrides(RunConfig(), ["algorithm.tis_cap=2"]).algorithm.tis_cap == 2.0
    with pytest.raises(ConfigError, match=r"algorithm.tis_cap must be 0 \(off\) or >= 1, got 0.5"):
        apply_overrides(RunConfig(), ["algorithm.tis_cap=0.5"])
    for extra in ("algorithm.mini_batches=2", "algorithm.update_epochs=2"):
        with pytest.raises(ConfigError, match="set algorithm.mini_batches=1 and "
                                              "algorithm.update_epochs=1"):
            apply_overrides(RunConfig(), ["algorithm.tis_cap=2", extra])


def test_the_fp8_story_holds_and_is_told_in_help_and_docs(capsys: pytest.CaptureFixture) -> None:
    """FP8_STORY's claims, each checked: the refusals, SkyRL's spellings, the one line a run
    without tis_cap starts with; and the text ends --help and stands in docs/configuration.md."""
    from pathlib import Path

    from workbench.cli import build_parser
    from workbench.config import FP8_STORY
    from workbench.rl.train import fp8_ratio_line

    base = PRESETS["tiny"]
    with pytest.raises(ConfigError, match="engine.vllm_fp8 .* needs engine.name=vllm"):
        apply_overrides(base, ["engine.vllm_fp8=true"])
    with pytest.raises(ConfigError, match="tis_cap must be 0 .* or >= 1"):
        apply_overrides(base, ["algorithm.tis_cap=0.5"])
    with pytest.raises(ConfigError, match="algorithm.mini_batches=1"):
        apply_overrides(base, ["algorithm.tis_cap=2", "algorithm.mini_batches=2"])
    skyrl = apply_overrides(base, ["trainer.fp8_base=true",
                                   "trainer.algorithm.tis_imp_ratio_cap=2"])
    assert (skyrl.speed.fp8_base, skyrl.algorithm.tis_cap) == (True, 2.0)
    assert fp8_ratio_line(skyrl) == ""
    alone = apply_overrides(base, ["speed.fp8_base=true"])
    assert fp8_ratio_line(alone).startswith("speed.fp8_base with algorithm.tis_cap=0:")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert " ".join(capsys.readouterr().out.split()).endswith(" ".join(FP8_STORY.split()))
    docs = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    assert " ".join(FP8_STORY.split()) in " ".join(docs.split())
