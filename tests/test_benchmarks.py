"""The benchmarks time the product's own step: `benchmarks.gpu` on the CPU with the tiny model,
the timings `python -m workbench train` logs for it, and the scaling fit's arithmetic."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import gpu, gpu_paths, scale, update_probe
from workbench.config import PRESETS, apply_overrides
from workbench.envs import eval_set
from workbench.loggers import read_metrics

SMALL = ["--model", "tiny", "--device", "cpu", "--mazes", "2", "--group", "2", "--turns", "2"]


def test_the_gpu_script_runs_the_products_step_on_the_cpu(tmp_path: Path) -> None:
    lines: list[str] = []
    summary = gpu.bench([*SMALL, "--steps", "1", "--eval", "--decode", "3", "--numerics",
                         "--profile", "1", "--workdir",
                         str(tmp_path), "--out", str(tmp_path / "summary.json"),
                         "eval.n_mazes=2", "eval.sampled_passes=0"], log=lines.append)
    assert summary["steps"] == 1 and summary["config"]["engine"] == "transformers"
    assert len([ln for ln in lines if ln.startswith("step ")]) == 2  # the warm-up step, then 1
    phases = [summary[k] for k in ("rollout_s", "update_s", "weight_sync_s", "step_s")]
    assert all(s > 0 for s in phases) and summary["step_s"] >= summary["rollout_s"]
    assert summary["update_tokens_per_s"] > 0 and summary["turns_mean"] == 2.0
    assert summary["eval_s"] > 0 and summary["decode"]["rows"] == 4
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["update/datums"] == 4 for r in rows)  # parity: every episode trained
    assert (tmp_path / "summary.json").is_file()
    assert 0 <= summary["clip_fraction"] <= 1
    # --numerics: the update's forward and the forward without grad score the same float32
    # tokens on the CPU (no FP8 there), each as close to our sampler's log-probs as it is
    grad, no_grad = summary["numerics"]["with_grad"], summary["numerics"]["no_grad_bf16"]
    assert grad["tokens"] == no_grad["tokens"] > 0
    assert grad["kl_sampler_trainer"] == pytest.approx(no_grad["kl_sampler_trainer"], abs=1e-9)
    assert abs(grad["kl_sampler_trainer"]) < 1e-6 and grad["clip_fraction"] == 0.0
    # --profile: one call of the host's, its CPU operators (no GPU kernels on a CPU)
    profile = summary["profile"]
    assert profile["calls"] == 1 and profile["wall_s"] > 0 and profile["top_kernels"] == []
    assert any(name.startswith("aten::") for name, _, _ in profile["top_cpu_ops"])


def test_side_by_side_runs_each_backend_as_its_own_process_and_tables_the_ratio(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--backend inprocess,ray: two child runs of the same step (a real local Ray for the
    second), each summary kept, one table row each with its step over the in-process step."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the children's Ray: no token in ~/.ray
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    lines: list[str] = []
    summary = gpu.bench([*SMALL, "--steps", "1", "--backend", "inprocess,ray", "--workdir",
                         str(tmp_path), "--out", str(tmp_path / "side.json")], log=lines.append)
    runs = summary["runs"]
    assert list(runs) == ["inprocess", "ray"]
    assert [runs[b]["config"]["backend"] for b in runs] == ["inprocess", "ray"]
    assert [r["step"] for r in read_metrics(tmp_path / "ray" / "run")] == [1, 2]
    rows = summary["table"].splitlines()[2:]
    assert rows[0].startswith("| inprocess |") and rows[0].endswith("| 1.00x |")
    ratio = runs["ray"]["step_s"] / runs["inprocess"]["step_s"]
    assert rows[1].startswith("| ray |") and rows[1].endswith(f"| {ratio:.2f}x |")
    assert json.loads((tmp_path / "side.json").read_text())["table"] == summary["table"]


def test_side_by_side_keeps_a_failed_runs_first_error_line() -> None:
    assert gpu.without(["--steps", "2", "--backend", "a,b", "--out=x", "k=v"],
                       ("--backend", "--out")) == ["--steps", "2", "k=v"]
    table = gpu.side_table({
        "inprocess/merged": {"step_s": 2.0, "rollout_s": 1.0, "update_s": 1.0},
        "ray/merged": {"returncode": 1, "error": gpu_paths.first_error(
            "Traceback\n  File x\nRuntimeError: no | GPU\n")},
        "inprocess/adapter": {"step_s": 4.0}, "ray/adapter": {"step_s": 4.4}})
    rows = table.splitlines()[2:]
    assert rows[1].startswith("| ray/merged | RuntimeError: no / GPU |")
    assert rows[2].endswith("| 1.00x |") and rows[3].endswith("| 1.10x |")
    assert rows[0].split(" | ")[1:4] == ["2", "1", "1"]


def test_a_backend_or_lora_way_not_known_names_the_valid_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpu.parse([*SMALL, "--backend", "inprocess,kuberay"])
    assert "--backend kuberay: choose from inprocess, ray" in capsys.readouterr().err


def test_the_service_overhead_benchmark_runs_one_loop_both_ways(tmp_path: Path,
                                                                 sft_model: str) -> None:
    """benchmarks.service_overhead on the CPU: the same seeds and weights give the same
    episodes in-process and through the server (the same losses, the same tokens)."""
    pytest.importorskip("tinker")
    from benchmarks import service_overhead

    os.environ["TINKER_TELEMETRY"] = "0"
    summary = service_overhead.bench(["--model", sft_model, "--steps", "1", "--warmup", "0",
                                      "--turns", "2", "--workdir", str(tmp_path), "--out",
                                      str(tmp_path / "service.json")], log=lambda _: None)
    assert summary["same_losses"] is True
    assert summary["inprocess"]["tokens"] == summary["server"]["tokens"] > 0
    assert summary["overhead"] == pytest.approx(
        summary["server"]["step_s"] / summary["inprocess"]["step_s"] - 1)
    assert json.loads((tmp_path / "service.json").read_text())["P"] == 2


def test_the_update_mfu_counts_four_flops_a_text_weight_a_token() -> None:
    """update_mfu's convention on the small shape with LoRA: per token 4 x the frozen text
    linear weights (every layer's q, k, v, o, gate, up, down, counted by hand), against the
    H200's 989 TFLOP/s."""
    from workbench.model import LoraSettings, add_lora
    from workbench.model.presets import build_random

    lm = build_random("qwen3-vl-small-shape", device="cpu")
    text = lm.model.config.text_config
    heads, kv, head_dim = (text.num_attention_heads, text.num_key_value_heads, text.head_dim)
    per_layer = (2 * text.hidden_size * heads * head_dim + 2 * text.hidden_size * kv * head_dim
                 + 3 * text.hidden_size * text.intermediate_size)
    model = add_lora(lm.model, LoraSettings(rank=4, alpha=8))
    out = gpu.update_mfu({"update_tokens_per_s": 1e6}, model)
    expected = 1e6 * 4 * per_layer * text.num_hidden_layers / 1e12
    assert out["update_model_tflops"] == pytest.approx(expected)
    assert out["update_mfu_bf16_peak"] == pytest.approx(expected / 989.0)


def test_then_off_policy_times_both_in_one_run(tmp_path: Path) -> None:
    """--then-off-policy: the warm-up and timed on-policy steps, then in the same run a fill
    step, the timed lagged steps and a drain step, each lagged step trained on the rollout
    sampled during the update before it."""
    summary = gpu.bench([*SMALL, "--steps", "1", "--then-off-policy", "--workdir",
                         str(tmp_path)], log=lambda line: None)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["rollout/policy_lag"] for r in rows] == [0, 0, 0, 1, 1]
    assert summary["steps"] == 1 and summary["off_policy"]["steps"] == 1
    assert summary["off_policy"]["step_s"] == rows[3]["time/step"]
    assert summary["step_s"] == rows[1]["time/step"]


def test_off_policy_needs_a_warm_up_step(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gpu.parse([*SMALL, "--off-policy", "--warmup", "0"])
    assert "--off-policy needs --warmup >= 1" in capsys.readouterr().err


def test_train_logs_the_phases_and_evaluation_times(tmp_path: Path) -> None:
    from workbench.rl.train import train

    config = apply_overrides(PRESETS["tiny"], [
        "model.name=tiny", "trainer.total_steps=1", "trainer.train_batch_size=2",
        "generator.n_samples_per_prompt=2", "generator.max_turns=2", "eval.n_mazes=2",
        "eval.sampled_passes=0", "algorithm.advantage=parity", "trainer.ckpt_interval=0",
        "trainer.hf_save_interval=0", f"run_dir={tmp_path}"])
    train(config, log=lambda *_: None)
    rows = read_metrics(tmp_path)
    evals, steps = [r for r in rows if "eval/n_mazes" in r], [r for r in rows if "time/step" in r]
    assert [r["step"] for r in evals] == [0, 1] and all(r["time/eval"] > 0 for r in evals)
    (step,) = steps
    assert all(step[k] >= 0 for k in gpu.PHASES) and step["update/datums"] == 4
    assert step["rollout/tokens_mean"] > step["rollout/reply_tokens_mean"] > 0


def test_the_turns_fit_of_a_line_and_of_a_square() -> None:
    line = scale.fit_linear([5, 10, 15], [12.0, 22.0, 32.0])  # 2 + 2 t
    assert line["a"] == pytest.approx(2.0) and line["b"] == pytest.approx(2.0)
    assert line["max_residual_frac"] == pytest.approx(0.0, abs=1e-12)
    assert line["increment_ratio"] == pytest.approx(1.0) and line["marginal"] == [2.0, 2.0]
    assert line["quad_share_at_last"] == pytest.approx(0.0, abs=1e-12)
    square = scale.fit_linear([5, 10, 15], [25.0, 100.0, 225.0])  # t^2
    assert square["increment_ratio"] == pytest.approx(5 / 3)
    assert square["ratio_last_first"] == pytest.approx(9.0)
    assert square["quad_share_at_last"] == pytest.approx(1.0)


def test_the_glue_engine_plays_every_turn_of_the_8b_shapes_rollout() -> None:
    """`bench glue`'s engine: unparseable replies at once, so every episode plays all its turns,
    through the 8B shape's processor (64 image tokens a 225 px maze)."""
    import torch

    from benchmarks.bench import InstantEngine, unparseable_reply
    from workbench.model.presets import build_random
    from workbench.policy import SamplingParams
    from workbench.rl.rollout import play_model

    lm = build_random("qwen3-vl-small-shape", torch.float32, "cpu")
    task = apply_overrides(PRESETS["seed_gpu"], ["generator.max_turns=3"]).task
    reply = unparseable_reply(lm)
    assert reply == list(range(151000, 151008))  # the 8B shape's vocabulary holds them
    episodes = play_model(lm, task, eval_set(9, 2), 2, SamplingParams(max_tokens=8),
                          torch.Generator().manual_seed(0), InstantEngine(reply))
    flat = [ep for group in episodes for ep in group]
    assert len(flat) == 4 and all(ep.turns == 3 for ep in flat)
    assert all(ep.sampled_tokens == [reply] * 3 for ep in flat)
    assert all(ep.stream.mm_types_T.count(1) == 3 * 64 for ep in flat)
    for ep in flat:  # vLLM's own loop replays each stream: its turns' segments between replies
        segments, runs = gpu.turn_segments(ep.stream), gpu.reply_runs(ep.stream)
        assert len(segments) == len(runs) == 3
        rebuilt = sum((seg.tokens_T + ep.stream.tokens_T[a:b]
                       for seg, (a, b) in zip(segments, runs)), [])
        assert rebuilt == ep.stream.tokens_T[:runs[-1][1]]  # the last reply's <|im_end|> after
        assert ep.stream.tokens_T[runs[0][0]:runs[0][1]] == reply
        assert [im for seg in segments for im in seg.images] == list(ep.stream.images)
        assert [len(seg.images) for seg in segments] == [1, 1, 1]


def test_the_update_probe_reads_a_trace_as_a_timeline() -> None:
    """20 ms slices: each kernel's time counts in the slice it starts in, each top-level host
    operator in the slice it starts in; the call spans its first operator to its last end."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::cat", "ts": 1000.0, "dur": 30000.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::inner", "ts": 2000.0, "dur": 1000.0},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 26000.0, "dur": 10000.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 51000.0, "dur": 5000.0},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3000.0}]}
    t = update_probe.timeline(trace)
    assert (t["first_gpu_ms"], t["gpu_busy_ms"], t["call_ms"]) == (25.0, 15.0, 55.0)
    assert [s["gpu_busy"] for s in t["slices"]] == [0.0, 0.5, 0.25]
    assert t["slices"][0]["host"] == [["aten::cat", 30.0]]  # aten::inner is inside it
    assert update_probe.timeline({"traceEvents": []})["slices"] == []


def test_the_update_probe_times_and_traces_an_update_call_on_the_cpu(tmp_path: Path) -> None:
    """The probe's own code path on the CPU (the tiny model, eager): 3 timed repeats, a trace
    beside its JSON, no GPU operation in it."""
    out = update_probe.main(["--calls", "1", "--out", str(tmp_path / "probe.json"),
                             "model.name=tiny", "model.device=cpu", "model.dtype=float32",
                             "speed.fp8_base=false", "speed.compile_layers=false"])
    assert len(out["call_s_repeats"]) == 3 and out["call_s"] > 0
    assert out["tokens_per_datum"] == 1236.0  # 15 turns of the seed's 9x9 maze, tiny's tokens
    assert out["timeline"]["first_gpu_ms"] is None and out["timeline"]["gpu_busy_ms"] == 0.0
    assert (tmp_path / "trace.json.gz").stat().st_size > 0
    assert json.loads((tmp_path / "probe.json").read_text())["call_s"] == out["call_s"]


def test_the_gpu_paths_runner_judges_a_path_and_prints_its_table(tmp_path: Path) -> None:
    """`make test-gpu`'s runner on the CPU (our engine, in-process, float32): two steps and a
    checkpoint, a resume of one more step and the evaluation; its row passes with the figures
    of its own steps, and results.json and the table say so."""
    cache = os.environ.get("WORKBENCH_CACHE")
    assert gpu_paths.main(["--only", "inprocess/ours", "--no-pytest", "--no-8b", "--device",
                           "cpu", "--out", str(tmp_path)]) == 0
    assert os.environ.get("WORKBENCH_CACHE") == cache  # the runner's cache is its children's
    result = json.loads((tmp_path / "results.json").read_text())
    [row] = result["rows"]
    assert (row["path"], row["status"], row["steps"]) == ("inprocess/ours", "pass", [1, 2, 3])
    assert row["step_s"] > 0 and row["kl"] is not None and row["peak_gpu_gb"] is None
    assert set(row["phases"]) == {"rollout", "update", "weight_sync"}
    table = (tmp_path / "table.md").read_text().splitlines()
    assert table[0].startswith("| path | result | step s |") and table[2].startswith(
        "| inprocess/ours | pass |")
    names = [p.name for p in gpu_paths.tiny_paths(tmp_path)]
    assert len(names) == 15 and {n.split("/")[0] for n in names} == set(gpu_paths.EXECUTORS)


def test_a_gpu_too_small_for_the_8b_rows_leaves_them_out_with_one_line(tmp_path: Path) -> None:
    """An 80 GB H100 ran the 8B rows out of memory beside the others: under 120 GB the command
    leaves them out and says how to run them alone; an H200, or a size unknown, keeps them."""
    names = [p.name for p in gpu_paths.seed_paths(tmp_path, tmp_path / "m")]
    line = gpu_paths.eight_b_left_out(85.0, names)  # an H100's 81,559 MiB
    assert line == ("the 8B rows left out: beside the other paths they need about 120 GB, and "
                    "this GPU has 85 GB (--only ray/seed_gpu-8b inprocess/seed_gpu-8b runs "
                    "them alone)")
    assert gpu_paths.eight_b_left_out(150.1, names) == gpu_paths.eight_b_left_out(None, names) \
        == ""


def test_a_failed_path_is_told_by_its_first_error_line() -> None:
    log = "INFO loading\nTraceback (most recent call last):\n  File x\nValueError: no cache\n"
    assert gpu_paths.first_error(log) == "ValueError: no cache"
    assert gpu_paths.first_error("") == "(no output)"


def test_the_gpu_tests_are_counted_from_pytests_junit_xml(tmp_path: Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite name="pytest" tests="25" failures="1" errors="1" '
                   'skipped="2"/></testsuites>')
    assert gpu_paths.junit_summary(xml) == "21 passed, 2 failed, 2 skipped"
