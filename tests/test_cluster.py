"""The Ray backend's plain parts, without a cluster: placement plans, datum shards and merged
outputs, engine seeds, connection errors, job overrides and the new config keys."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workbench.cluster.connect import check_reachable, explain_connect_error
from workbench.cluster.parallel import merge_outputs, padded_shards, split_B
from workbench.cluster.placement import plan_placement
from workbench.cluster.ray_session import chunk_seed, engine_spec
from workbench.cluster.weight_sync import check_distinct_gpus, flatten, unflatten
from workbench.config import PRESETS, ConfigError, apply_overrides
from workbench.jobs import job_overrides
from workbench.session.types import ForwardBackwardOutput


def test_colocated_plan_pairs_worker_i_with_engine_i() -> None:
    plan = plan_placement(2, 2, colocate_all=True, use_gpu=True, cpus_per_actor=0.5)
    assert plan.bundles == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert plan.trainer_bundle_N == plan.engine_bundle_M == [0, 1]
    assert plan.trainer_resources == plan.engine_resources == {"num_cpus": 0.5, "num_gpus": 0.5}
    uneven = plan_placement(2, 1, colocate_all=True, use_gpu=False, cpus_per_actor=0.5)
    assert uneven.bundles == [{"CPU": 1.0}, {"CPU": 0.5}]


def test_separate_plan_gives_every_actor_its_own_bundle() -> None:
    plan = plan_placement(2, 3, colocate_all=False, use_gpu=True, cpus_per_actor=1.0)
    assert plan.bundles == [{"CPU": 1.0, "GPU": 1.0}] * 5
    assert (plan.trainer_bundle_N, plan.engine_bundle_M) == ([0, 1], [2, 3, 4])
    assert plan.engine_resources == {"num_cpus": 1.0, "num_gpus": 1.0}
    cpu = plan_placement(1, 1, colocate_all=False, use_gpu=False)
    assert cpu.bundles == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert cpu.trainer_resources["num_gpus"] == 0.0


def test_shards_are_contiguous_and_cover_every_datum() -> None:
    assert split_B(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_B([1], 2) == [[1], []]
    assert sum(split_B(list(range(10)), 4), []) == list(range(10))


def test_padded_shards_give_empty_workers_a_zero_weight_datum(tiny) -> None:
    from workbench.envs import MazeConfig, MazeEnv, eval_set, system_prompt
    from workbench.policy import chat_format, start_stream
    from workbench.rl.rollout import observe
    from workbench.session import datum_from_stream

    fmt, maze = chat_format(tiny.processor), MazeConfig(size=5)
    env = MazeEnv(maze)
    obs, info = env.reset(options={"init_state": eval_set(5, 1)[0]})
    stream = observe(start_stream(tiny.processor, fmt, system_prompt(maze)), tiny.processor, fmt,
                     obs, info, maze)
    datum = datum_from_stream(stream, 1.0)
    shards, sizes = padded_shards([datum], 2)
    assert sizes == [1, 0] and shards[0] == [datum]
    assert len(shards[1]) == 1 and not any(shards[1][0].weights_T)


def _out(loss: float, tokens: int, kl: float, logprobs: list) -> ForwardBackwardOutput:
    return ForwardBackwardOutput(loss, {"loss": loss, "kl_sampler_trainer": kl,
                                        "clip_fraction": 0.0, "entropy": 1.0, "tokens": tokens},
                                 logprobs)


def test_merged_outputs_are_what_one_worker_returns() -> None:
    a, b = _out(1.5, 10, 0.2, [[0.0, -1.0]]), _out(-0.5, 30, 0.1, [[0.0], [0.0, -2.0]])
    merged = merge_outputs([a, b], [1, 2])
    assert merged.loss == 1.0 and merged.metrics["loss"] == 1.0
    assert merged.metrics["tokens"] == 40
    assert merged.metrics["kl_sampler_trainer"] == pytest.approx((0.2 * 10 + 0.1 * 30) / 40)
    assert merged.logprobs_B_T == [[0.0, -1.0], [0.0], [0.0, -2.0]]
    assert merge_outputs([a, _out(0.0, 0, 0.0, [[9.0]])], [1, 0]) is a  # padding dropped


def test_engine_seeds() -> None:
    assert chunk_seed(7, 0) == 7  # one engine samples exactly as in-process
    assert len({chunk_seed(7, k) for k in range(8)}) == 8
    assert chunk_seed(8, 1) != chunk_seed(7, 2)


def test_engines_size_their_kv_pool_for_their_share_of_the_rows() -> None:
    from workbench.policy.engine import EngineSettings
    from workbench.session.spec import ClusterSpec, SessionSpec

    spec = SessionSpec(engine=EngineSettings(kv_rows=64),
                       cluster=ClusterSpec("local", num_engines=3))
    assert engine_spec(spec).engine.kv_rows == 22  # ceil(64 / 3)
    assert engine_spec(spec).cluster == spec.cluster and engine_spec(spec).model == spec.model


def test_weight_broadcast_buffer_round_trips_and_needs_gpus_of_its_own() -> None:
    like = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    sent = {"a": torch.arange(6.0).view(2, 3), "b": torch.arange(4.0) + 10}
    got = unflatten(flatten(sent), like)
    assert all(torch.equal(got[k], sent[k]) for k in sent) and list(got) == ["a", "b"]
    with pytest.raises(ValueError, match="different specs"):
        unflatten(torch.zeros(5), like)
    with pytest.raises(ValueError, match="one dtype"):
        flatten({"a": torch.zeros(1), "b": torch.zeros(1, dtype=torch.bfloat16)})
    check_distinct_gpus("GPU-0", ["GPU-1", "GPU-2"])
    check_distinct_gpus("", ["", ""])  # CPU actors: gloo, no constraint
    with pytest.raises(ValueError, match="engine 1 shares rank 0's GPU"):
        check_distinct_gpus("GPU-0", ["GPU-1", "GPU-0"])


def test_unreachable_cluster_names_the_address_and_what_to_check() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(ConnectionError) as err:
        check_reachable(f"ray://127.0.0.1:{port}", timeout_s=2)
    assert f"127.0.0.1:{port}" in str(err.value) and "ray-client-server-port" in str(err.value)


def test_connect_environment_binds_loopback_and_uses_a_token_when_there(tmp_path) -> None:
    code = ("import os; from workbench.cluster.connect import prepare_environment; "
            "prepare_environment(); print(os.environ.get('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER'), "
            "os.environ.get('RAY_AUTH_MODE'))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {
        "HOME": str(tmp_path)}  # no ~/.ray/auth_token there
    run = [sys.executable, "-c", code]
    without = subprocess.run(run, env=clean, capture_output=True, text=True, check=True).stdout
    assert without.split() == ["0", "None"]
    token = clean | {"RAY_AUTH_TOKEN": "x" * 32}
    assert subprocess.run(run, env=token, capture_output=True, text=True,
                          check=True).stdout.split() == ["0", "token"]


MISMATCH = """
from ray._private.utils import check_version_info
try:
    check_version_info({"ray_version": "2.59.0", "python_version": "3.10.14"}, "Ray Client",
                       raise_on_mismatch=True, python_version_match_level="minor")
except RuntimeError as err:
    print(err)
"""


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs the ray extra")
def test_version_mismatch_names_both_versions() -> None:
    # Ray's own check against a 2.59 cluster, in a subprocess: importing ray here would come
    # before test_ray_local's connect(), which must set its loopback variable first.
    text = subprocess.run([sys.executable, "-c", MISMATCH], capture_output=True, text=True,
                          check=True).stdout
    assert "Version mismatch" in text, text
    err = explain_connect_error(RuntimeError(text), "ray://10.0.0.5:10001")
    assert isinstance(err, ConnectionError)
    text = str(err)
    assert "ray://10.0.0.5:10001" in text and "Ray 2.59.0 on Python 3.10.14" in text
    assert "2.60.0" in text and "ray==2.59.0" in text


def test_a_connect_error_hints_at_auth_only_when_it_timed_out(monkeypatch) -> None:
    """A Ray Client timeout without a token suggests the token; a client server that died
    while starting (a start-up race on the head) says to connect again, not to fetch a token."""
    monkeypatch.setattr(importlib.import_module("workbench.cluster.connect"), "token_available",
                        lambda: False)
    address = "ray://127.0.0.1:10001"
    timeout = str(explain_connect_error(ConnectionError("ray client connection timeout"),
                                        address))
    assert "auth_token" in timeout and "connect again" not in timeout
    died = str(explain_connect_error(ConnectionAbortedError(
        "Initialization failure from server:\nRay Client server died while starting"), address))
    assert "connect again" in died and "auth_token" not in died
    other = str(explain_connect_error(OSError("connection refused"), address))
    assert other == f"could not connect to Ray at {address}: OSError: connection refused."


def test_job_overrides_make_paths_absolute_and_target_the_cluster(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    out = job_overrides(["run_dir=runs/a", "model.name=model", "trainer.total_steps=2"])
    assert out == ["trainer.total_steps=2", f"run_dir={tmp_path / 'runs/a'}",
                   f"model.name={tmp_path / 'model'}", "cluster.address=auto"]
    in_job = job_overrides(["cluster.address="])  # the job trains in its own process
    assert "cluster.address=" in in_job and "cluster.address=auto" not in in_job
    with pytest.raises(ConfigError):
        job_overrides(["trainer.num_worker=2"])


def test_cluster_config_keys() -> None:
    config = apply_overrides(PRESETS["tiny"], [
        "cluster.address=ray://127.0.0.1:10001", "cluster.num_workers=2",
        "cluster.num_engines=3", "cluster.colocate_all=false", "cluster.strategy=ddp"])
    assert (config.cluster.num_workers, config.cluster.num_engines) == (2, 3)
    assert config.cluster.colocate_all is False
    assert PRESETS["tiny"].cluster.address == ""  # in-process by default
    for bad, needle in (("cluster.strategy=zero3", "ddp"), ("cluster.address=myhost", "ray://"),
                        ("cluster.num_workers=0", ">= 1"), ("cluster.strategy=fsdp", "cuda"),
                        ("cluster.adress=local", "cluster.address")):
        with pytest.raises(ConfigError, match=needle):
            apply_overrides(PRESETS["tiny"], [bad])


def test_fsdp_worker_shards_the_frozen_base_and_updates_like_one_device(tiny_dir,
                                                                       tmp_path) -> None:
    """One fsdp trainer worker (NCCL on a GPU, gloo here; world size 1), driven directly as
    its actor would be: the frozen base becomes DTensor shards, LoRA stays whole, the update
    equals in-process."""
    from dataclasses import replace

    from torch.distributed.tensor import DTensor

    from workbench.cluster.workers import TrainerWorker
    from workbench.envs import MazeConfig, eval_set
    from workbench.model import LoraSettings
    from workbench.policy import SamplingParams
    from workbench.rl.rollout import play_episodes
    from workbench.session import (
        AdamParams,
        ClusterSpec,
        LossConfig,
        SessionSpec,
        checkpoint,
        create_session,
        host,
    )
    from workbench.session.host import snapshot
    from workbench.session.types import datum_from_stream

    lora, cfg = LoraSettings(rank=4, alpha=8), LossConfig()
    adam = AdamParams(learning_rate=1e-3, eps=1e-6)  # eps: see test_ray_local's update test
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = SessionSpec(str(tiny_dir), lora, workdir=str(tmp_path / "ref"), device=device,
                       cluster=ClusterSpec(strategy="fsdp"))
    ref = create_session(spec)
    sampler = ref.training_client.save_weights_and_get_sampling_client()
    episodes = sampler.play(play_episodes, MazeConfig(size=5, max_turns=3), eval_set(5, 2), 2,
                            SamplingParams(max_tokens=2), 0).result()
    datums = [datum_from_stream(ep.stream, a) for group in episodes
              for ep, a in zip(group, (1.0, -1.0))]
    fb1 = ref.training_client.forward_backward(datums, "ppo", cfg).result()
    opt1 = ref.training_client.optim_step(adam).result()
    worker = TrainerWorker(replace(spec, workdir=str(tmp_path / "w")), 0)
    try:
        worker.join(*worker.open_store("127.0.0.1"))
        params = dict(worker.host.lm.model.named_parameters())
        assert any(isinstance(p, DTensor) for p in params.values())
        assert not any(isinstance(p, DTensor) for p in worker.host.trainable().values())
        fb2 = worker.call(host.forward, datums, "ppo", cfg, True)
        opt2 = worker.call(host.optim_step, adam)
        assert fb2.loss == pytest.approx(fb1.loss, rel=1e-5, abs=1e-6)
        assert opt2.grad_norm == pytest.approx(opt1.grad_norm, rel=1e-5)
        one, sharded = snapshot(ref.host), worker.snapshot()[1]
        assert max(float((sharded[k] - one[k].cpu()).abs().max()) for k in one) < 1e-5
        saved = worker.call(checkpoint.save_state, tmp_path / "state")
        assert checkpoint.is_complete(saved)
    finally:
        worker.close()
        ref.close()


def test_engine_speed_metrics_merge_fast_paths_and_cache_counts() -> None:
    from workbench.cluster.ray_session import merge_speed_metrics

    rows = [{"speed/cuda_graphs": 1.0, "vllm/prefix_cache_queried_tokens": 300.0,
             "vllm/prefix_cache_hit_rate": 0.9, "vllm/generate_s": 2.5, "vllm/requests": 60.0,
             "vllm/requests_rendered_whole": 4.0},
            {"speed/cuda_graphs": 0.0, "vllm/prefix_cache_queried_tokens": 100.0,
             "vllm/prefix_cache_hit_rate": 0.5, "vllm/generate_s": 3.0, "vllm/requests": 30.0,
             "vllm/requests_rendered_whole": 3.0}]
    assert merge_speed_metrics(rows) == {"speed/cuda_graphs": 0.0,
                                         "vllm/prefix_cache_queried_tokens": 400.0,
                                         "vllm/prefix_cache_hit_rate": (270 + 50) / 400,
                                         "vllm/generate_s": 3.0,  # engines run side by side
                                         "vllm/requests": 90.0,
                                         "vllm/requests_rendered_whole": 7.0}
    assert merge_speed_metrics([{"speed/compile_decode": 1.0}, {}]) == {
        "speed/compile_decode": 1.0}  # an engine without the path does not veto it


def test_jobs_leave_out_what_git_ignores_on_this_machine_only(tmp_path: Path) -> None:
    from workbench.jobs import local_excludes

    assert local_excludes(tmp_path) == []  # not a checkout
    (tmp_path / ".git" / "info").mkdir(parents=True)
    (tmp_path / ".git" / "info" / "exclude").write_text(
        "# local ignores\n\n/.carry/\n  /.whl/  \n*.tar.xz\n")
    assert local_excludes(tmp_path) == ["/.carry/", "/.whl/", "*.tar.xz"]


def test_a_colocated_trainer_hands_its_versions_to_the_engine_on_its_gpu() -> None:
    """`handoff_kind`: trainer k hands its version to engine k when they share a bundle, each
    engine has a trainer, and replicas are whole (ddp); the kind follows the engine."""
    from dataclasses import replace

    from workbench.cluster.ray_session import handoff_kind
    from workbench.policy.engine import EngineSettings
    from workbench.session import ClusterSpec, SessionSpec

    def kind(engine: EngineSettings, **cluster: object) -> str:
        return handoff_kind(SessionSpec(engine=engine, cluster=replace(ClusterSpec("local"),
                                                                       **cluster)))

    merged, adapter = EngineSettings("vllm", vllm_lora="merged"), EngineSettings("vllm")
    assert kind(merged) == "merged" and kind(adapter) == "adapter"
    assert kind(EngineSettings()) == "factors"  # our engine: its own model, LoRA tensors sent
    assert kind(merged, num_workers=2, num_engines=2) == "merged"
    assert kind(merged, colocate_all=False) == ""  # separate GPUs: the object store
    assert kind(merged, num_engines=2) == ""  # an engine without a trainer beside it
    assert kind(merged, strategy="fsdp") == ""  # a worker holds a shard of the base


def test_our_engine_on_ray_is_sized_from_the_model_and_its_kv_pool() -> None:
    """`sampler_need` at the 8B shape (bf16): the weights, the fused text matrices, the KV pool
    of kv_rows x kv_tokens (36 layers x 8 KV heads x 128 x K and V), a workspace; a GPU with
    less free refuses the actor in one line that names the keys to change."""
    from dataclasses import replace

    from workbench.cluster.workers import check_sampler_memory, sampler_need
    from workbench.model.presets import QWEN3_VL_8B, param_counts, shape_config
    from workbench.model.tokenizer import build_tokenizer
    from workbench.policy.engine import EngineSettings
    from workbench.session import SessionSpec

    config = shape_config(QWEN3_VL_8B, build_tokenizer(512).get_vocab())
    spec = SessionSpec(dtype="bfloat16", device="cuda",
                       engine=EngineSettings(cuda_graphs=True, kv_rows=64, kv_tokens=2048))
    need = sampler_need(spec, config)
    counts = param_counts(config)
    assert need["weights"] == 2 * counts["total"] and need["fused"] == 2 * counts["text_linear"]
    assert need["kv_pool"] == 64 * 2048 * 36 * 2 * 8 * 128 * 2 == 19_327_352_832
    assert need["workspace"] == 2 * 64 * 151936 * 4 + (need["weights"] + need["fused"]
                                                      + need["kv_pool"]) // 10
    assert need["total"] == sum(v for k, v in need.items() if k != "total")
    unfused = sampler_need(replace(spec, engine=replace(spec.engine, fused_decode=False)), config)
    assert unfused["fused"] == 0
    on_cpu = sampler_need(replace(spec, device="cpu"), config)  # no CUDA graphs, no fused copy
    assert on_cpu["fused"] == 0
    assert check_sampler_memory(spec, config, need["total"]) == need["total"]
    with pytest.raises(RuntimeError, match=r"^our engine \(engine.name=transformers\) needs "
                       r"5\d\.\d GiB on its GPU .* but 40\.0 GiB is free: lower engine.kv_rows"):
        check_sampler_memory(spec, config, 40 * 2**30)
