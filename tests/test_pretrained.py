"""The pretrained tiny policy: deterministic bytes, its report, the cache, and reward variance
from a first GRPO step (the reason it exists)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from workbench.config import PRESETS, apply_overrides
from workbench.model.load import resolve_model_path
from workbench.rl.pretrained import RECIPE, describe, read_report, tiny_sft_path, weights_sha256

VENDOR = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
               .splitlines() if line.startswith("vendor_id")), "")
"""This machine's CPU vendor: the build pins its kernels (PINNED_ENV) and is the same bytes twice
on one CPU, but an AMD EPYC and an Intel Xeon (with AVX-512) build different bytes."""

PINNED: dict[str, tuple[str, tuple[float, float], tuple[float, float]]] = {
    "AuthenticAMD": ("3a03eeb4245093508580352d55d16ced6963117a07734822ba643716f06ab76b",
                     (13.0, 15.0), (7.0, 11.0)),
    "GenuineIntel": ("749179e141d0c639581e350aec2c21437beeac9bf33cb7c5230336914c349b4e",
                     (22.0, 14.0), (9.0, 15.0)),
}
"""By CPU vendor: sha256 of tiny-sft's model.safetensors as built by RECIPE with the locked stack
(torch 2.14.1, transformers 5.20.2), and its report's held-out 9x9 and 7x7 (greedy, sampled)."""
PINNED_SHA256, NINE, SEVEN = PINNED[VENDOR]


def test_build_writes_the_pinned_bytes(tiny_sft_dir: Path) -> None:
    report = read_report(tiny_sft_dir)
    assert weights_sha256(tiny_sft_dir) == report["weights_sha256"] == PINNED_SHA256
    assert report["recipe"] == {"overrides": list(RECIPE.overrides), "threads": RECIPE.threads,
                                "report_sizes": list(RECIPE.report_sizes)}
    assert tiny_sft_dir.name == f"tiny-sft-{RECIPE.build_hash}"


def test_report_holds_the_held_out_evaluation(tiny_sft_dir: Path) -> None:
    report = read_report(tiny_sft_dir)
    assert list(report["sizes"]) == ["9", "7"]
    nine, seven = report["sizes"]["9"], report["sizes"]["7"]
    for size in (nine, seven):
        assert (size["greedy"]["n_mazes"], size["greedy"]["episodes_per_maze"]) == (64, 1)
        assert size["sampled"]["episodes_per_maze"] == int(RECIPE.setting("eval.sampled_passes"))
    assert (nine["greedy"]["ceiling"], seven["greedy"]["ceiling"]) == (50, 63)
    # the pinned bytes play the held-out sets exactly so: a fraction solved, room to climb
    assert (nine["greedy"]["solved"], nine["sampled"]["solved"]) == NINE
    assert (seven["greedy"]["solved"], seven["sampled"]["solved"]) == SEVEN
    line = describe(report)
    assert line.startswith("tiny-sft: built in ") and f"9x9 greedy {NINE[0]}/64, sampled " \
        f"{NINE[1]}/64 (ceiling 50/64); 7x7 greedy {SEVEN[0]}/64" in line \
        and line.endswith("at T=0.7")
    metrics = [json.loads(line) for line in (tiny_sft_dir / "sft_metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == list(range(1, int(RECIPE.setting("sft.steps")) + 1))


def test_the_name_resolves_to_the_cached_build(tiny_sft_dir: Path, workbench_cache: Path) -> None:
    assert resolve_model_path("tiny-sft") == str(tiny_sft_dir)
    assert tiny_sft_dir.is_relative_to(workbench_cache)
    before = (tiny_sft_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny_sft_path() == tiny_sft_dir
    assert (tiny_sft_dir / "model.safetensors").stat().st_mtime_ns == before  # not rebuilt
    assert PRESETS["tiny"].model.name == "tiny-sft"


def test_first_grpo_step_from_it_has_reward_variance(tiny_sft_dir: Path, tmp_path: Path) -> None:
    from workbench.opener import open_session, session_spec
    from workbench.rl import phases
    from workbench.rl.schedule import step_batch

    config = apply_overrides(PRESETS["tiny"], ["trainer.train_batch_size=4",
                                               "generator.n_samples_per_prompt=4"])
    session = open_session(session_spec(config, tmp_path))
    try:
        sampler = session.training_client.save_weights_and_get_sampling_client()
        ro = phases.rollout(sampler, replace(step_batch(config, 1), seed=0))
    finally:
        session.close()
    rewards_P_G = phases.score(ro).rewards_P_G
    adv = phases.advantages(rewards_P_G)
    assert 0 < rewards_P_G.mean() < 1
    assert adv.zero_variance_groups < 4 and np.abs(adv.advantages_P_G).sum() > 0
