"""The session on a local Ray instance: a real `ray.init` (2 CPUs, auth off, dashboard and every
service on 127.0.0.1), one per module.

- a run on Ray actors writes the same metrics.jsonl as the in-process run;
- actors land in the placement-group bundles the placement plan gives them;
- a run whose sampler engine and trainer worker are killed mid-run ends as the undisturbed run;
- two data-parallel workers make the same update as one, on the same batch;
- a rollout spread over two engines returns each maze's episodes, in maze order, as the
  in-process sampler plays them with the same seeds.
"""

from __future__ import annotations

import importlib.util
import itertools
import operator
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from workbench.cluster import connect, create_ray_session, disconnect
from workbench.cluster.metrics import gauge_name
from workbench.cluster.placement import actor_bundles
from workbench.cluster.ray_session import chunk_seed
from workbench.config import PRESETS, apply_overrides
from workbench.envs import MazeConfig, eval_set
from workbench.model import LoraSettings
from workbench.policy import SamplingParams
from workbench.rl.phases import global_weights
from workbench.rl.rollout import play_episodes
from workbench.rl.train import train
from workbench.run import read_metrics
from workbench.session import (
    AdamParams,
    ClusterSpec,
    LossConfig,
    SessionSpec,
    SpeedSettings,
    create_session,
    datum_from_stream,
)
from workbench.session.host import snapshot

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                reason="needs the ray extra (pip install 'workbench[ray]')")

LORA = LoraSettings(rank=4, alpha=8)
MAZE = MazeConfig(size=5, max_turns=3)
PARAMS = SamplingParams(max_tokens=2)
RUN = ["trainer.total_steps=3", "trainer.ckpt_interval=1", "trainer.eval_interval=0",
       "trainer.hf_save_interval=0", "eval.n_mazes=2", "eval.sampled_passes=0",
       "algorithm.learning_rate=1e-3", "trainer.resume_mode=none"]
ON_RAY = ["cluster.address=local", "cluster.colocate_all=false"]


@pytest.fixture(scope="module")
def local_ray(ray_temp_dir: Path):
    """One local Ray instance for the module (token auth off, usage stats off)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        info = connect("local", num_cpus=2, dashboard=True, temp_dir=ray_temp_dir)
        yield info
        disconnect()


def _config(small_run: list[str], model: str, run_dir: Path, extra: list[str]):
    return apply_overrides(PRESETS["tiny"], small_run + RUN + [f"model.name={model}",
                                                              f"run_dir={run_dir}"] + extra)


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.fixture(scope="module")
def inprocess_run(sft_model: str, small_run: list[str],
                  tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 3-step reference run, in-process, on one thread as Ray's actors run (Ray sets
    OMP_NUM_THREADS=1 for an actor with less than one CPU)."""
    run_dir = tmp_path_factory.mktemp("inprocess")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(_config(small_run, sft_model, run_dir, []), log=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    return run_dir


def test_local_instance_binds_to_loopback(local_ray) -> None:
    import psutil

    assert local_ray.kind == "local" and local_ray.ray_version
    host, port = local_ray.address.rsplit(":", 1)
    assert host == "127.0.0.1", local_ray
    assert "127.0.0.1" in local_ray.dashboard_url
    gcs = [c for c in psutil.net_connections("tcp")
           if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port)]
    assert gcs and all(c.laddr.ip in ("127.0.0.1", "::ffff:127.0.0.1") for c in gcs), gcs


@pytest.fixture(scope="module")
def ray_run(local_ray, inprocess_run: Path, sft_model: str, small_run: list[str],
            tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same 3-step run on Ray actors (separate bundles): its folder and its layout."""
    run_dir = tmp_path_factory.mktemp("ray") / "ray-metrics-run"
    trainer = train(_config(small_run, sft_model, run_dir, ON_RAY), log=lambda *_: None)
    try:
        session = trainer.session
        return {"run_dir": run_dir, "backend": session.describe()["backend"],
                "bundles": session.plan.bundles, "names": session.actor_names,
                "placed": actor_bundles(session.placement_group),
                "exported": _exported_metrics(run_dir)}  # while trainer 0 (their source) lives
    finally:
        trainer.session.close()


def test_ray_run_matches_inprocess_and_uses_separate_bundles(ray_run: dict,
                                                             inprocess_run: Path) -> None:
    assert ray_run["backend"]["kind"] == "ray"
    assert ray_run["bundles"] == [{"CPU": 0.5}, {"CPU": 0.5}]
    names = ray_run["names"]
    assert ray_run["placed"] == {names[0]: 0, names[1]: 1}, ray_run["placed"]
    ray_rows, ref_rows = read_metrics(ray_run["run_dir"]), read_metrics(inprocess_run)
    assert sum(r.get("update/datums", 0) for r in ref_rows) > 0, "no update to compare"
    assert _comparable(ray_rows) == _comparable(ref_rows)


def test_off_policy_run_on_ray_matches_inprocess(local_ray, sft_model: str,
                                                  small_run: list[str], tmp_path: Path) -> None:
    """algorithm.off_policy_steps=1 on Ray, whose engines sample step k+1 while the trainer
    updates step k, ends exactly as the same run in-process, where the two take turns on one
    worker: the same rollouts, losses and weights (policy lags 0, 1, 1)."""
    extra = ["algorithm.off_policy_steps=1", "trainer.ckpt_interval=0"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as Ray's actors run
    try:
        train(_config(small_run, sft_model, tmp_path / "inprocess", extra), log=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    trainer = train(_config(small_run, sft_model, tmp_path / "ray", extra + ON_RAY),
                    log=lambda *_: None)
    trainer.session.close()
    ray_rows, ref_rows = read_metrics(tmp_path / "ray"), read_metrics(tmp_path / "inprocess")
    assert [r["rollout/policy_lag"] for r in ref_rows if "reward/mean" in r] == [0, 1, 1]
    assert sum(r.get("update/datums", 0) for r in ref_rows) > 0, "no update to compare"
    assert _comparable(ray_rows) == _comparable(ref_rows)


def _prometheus_values(port: int, names: list[str], run: str) -> dict[str, float]:
    """The node's metrics endpoint (Prometheus text): value of each `ray_<name>{run=...}`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        metric, _, rest = line.partition("{")
        if metric in names and f'run="{run}"' in rest:
            out[metric] = float(line.rsplit(" ", 1)[1])
    return out


def _metric_names(run_dir: Path) -> tuple[dict[str, float], str]:
    """The Prometheus names and values the run's last step and eval should export, and the name
    of the rollout time (a value not known in advance)."""
    rows = read_metrics(run_dir)
    last_step = [r for r in rows if "reward/mean" in r][-1]
    last_eval = [r for r in rows if "eval/n_mazes" in r][-1]
    want = {"ray_" + gauge_name(k): float(v) for k, v in (
        ("reward/mean", last_step["reward/mean"]), ("update/datums", last_step["update/datums"]),
        ("rollout/success_rate", last_step["rollout/success_rate"]),
        ("eval/greedy_solved", last_eval["eval/greedy_solved"]))}
    return want, "ray_" + gauge_name("time/rollout")


def _exported_metrics(run_dir: Path) -> dict[str, float]:
    """What the node's metrics endpoint shows for the run, once it shows the last step's values
    (Ray's agent exports what the worker reported some seconds before: right after a run, the
    endpoint may still show an earlier step's values; waiting for that event), or after 120 s."""
    import ray

    want, rollout_time = _metric_names(run_dir)
    names, port = [*want, rollout_time], ray.nodes()[0]["MetricsExportPort"]
    deadline, seen = time.monotonic() + 120, {}

    def caught_up(values: dict[str, float]) -> bool:
        return ({k: v for k, v in values.items() if k != rollout_time} == want
                and values.get(rollout_time, 0.0) > 0.0)

    while not caught_up(seen) and time.monotonic() < deadline:
        time.sleep(0.5)
        seen = _prometheus_values(port, names, run_dir.name)
    return seen


def test_step_metrics_reach_rays_metrics_endpoint(ray_run: dict) -> None:
    """The last step's and eval's metrics, set as gauges in trainer worker 0, reach the node's
    Prometheus endpoint. They are read while the run's actors live: read after a later Ray run
    in this module (the off-policy one) had come and gone, the endpoint showed none of them."""
    want, rollout_time = _metric_names(ray_run["run_dir"])
    seen = dict(ray_run["exported"])
    assert seen.pop(rollout_time, 0.0) > 0.0, seen
    assert seen == want


def test_replay_eval_and_sft_on_ray_open_the_run_spec(ray_run: dict, tmp_path: Path) -> None:
    """Replay, eval and SFT of a Ray run open Ray sessions from the run's own spec (cluster,
    speed, device included); the replayed update is exact."""
    import json
    from dataclasses import replace

    from workbench.config import from_dict
    from workbench.opener import read_spec
    from workbench.rl.eval_model import evaluate_model
    from workbench.rl.replay import replay
    from workbench.rl.sft import run_sft

    run_dir = ray_run["run_dir"]
    config = from_dict(json.loads((run_dir / "config.json").read_text()))
    spec = read_spec(run_dir)
    assert (spec.cluster.address, spec.cluster.colocate_all) == ("local", False)
    result = replay(run_dir, 2)
    assert result.exact, (result.logged, result.replayed)
    assert read_spec(run_dir / "replay") == replace(spec, workdir=str(run_dir / "replay"))
    record = evaluate_model(config, log=lambda *_: None)
    assert [r.n_mazes for r in record.results] == [2]
    [workdir] = [p for p in run_dir.iterdir() if p.name.startswith("eval-")]
    assert read_spec(workdir) == replace(spec, workdir=str(workdir))
    sft = replace(config, run_dir=str(tmp_path / "sft"),
                  sft=replace(config.sft, steps=1, batch_size=1, full_finetune=False))
    assert (run_sft(sft, log=lambda *_: None) / "model.safetensors").is_file()
    assert read_spec(tmp_path / "sft") == replace(
        spec, workdir=str(tmp_path / "sft"), cluster=replace(spec.cluster, num_engines=0))


def _wait_until_dead(name: str) -> None:
    import ray

    deadline = time.monotonic() + 60
    while name in ray.util.list_named_actors() and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for an event (the actor's death), not for time to pass
    assert name not in ray.util.list_named_actors(), f"{name} did not die"


def test_killed_actors_are_replaced_and_the_run_ends_as_undisturbed(
        local_ray, inprocess_run: Path, sft_model: str, small_run: list[str],
        tmp_path: Path) -> None:
    import ray

    before = set(ray.util.list_named_actors())
    kills = {"step    1": "engine-0", "step    2": "trainer-0"}  # summary line -> victim
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        victim = next((kills.pop(p) for p in list(kills) if line.startswith(p)), None)
        if victim is None:
            return
        [name] = [n for n in ray.util.list_named_actors()
                  if n.endswith("/" + victim) and n not in before]
        actor = ray.get_actor(name)
        if victim.startswith("engine"):  # ray.kill: Ray's own way
            ray.kill(actor, no_restart=True)
            _wait_until_dead(name)
        else:  # the worker process dies (SIGKILL), as on an out-of-memory kill
            os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)

    trainer = train(_config(small_run, sft_model, tmp_path / "faults", ON_RAY), log=log)
    trainer.session.close()
    reopened = [x for x in lines if "reopening the session" in x]
    assert not kills and len(reopened) == 2, lines
    assert "after step 1" in reopened[0] and "after step 2" in reopened[1], reopened
    assert sum("resumed from" in x and "global_step_1" in x for x in lines) == 2, lines
    rows = read_metrics(tmp_path / "faults")
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
    assert _comparable(rows) == _comparable(read_metrics(inprocess_run))


@pytest.fixture(scope="module")
def dp_session(local_ray, sft_model: str, tmp_path_factory: pytest.TempPathFactory):
    """2 trainer workers + 2 sampler engines, colocated (a quarter CPU each)."""
    cluster = ClusterSpec("local", num_workers=2, num_engines=2, colocate_all=True,
                          cpus_per_actor=0.25)
    session = create_ray_session(SessionSpec(sft_model, LORA, str(tmp_path_factory.mktemp("dp")),
                                             cluster=cluster))
    yield session
    session.close()


@pytest.fixture(scope="module")
def ref_session(sft_model: str, tmp_path_factory: pytest.TempPathFactory):
    """The same model in-process: one host, the reference for the Ray results."""
    session = create_session(SessionSpec(sft_model, LORA, str(tmp_path_factory.mktemp("ref"))))
    yield session
    session.close()


@pytest.fixture(scope="module")
def rollouts(dp_session, ref_session) -> tuple[list, list]:
    """3 mazes x 2 episodes from the two engines, and from in-process (before any update)."""
    states = eval_set(5, 3)
    sampler = dp_session.training_client.save_weights_and_get_sampling_client()
    got = sampler.play(play_episodes, MAZE, states, 2, PARAMS, seed=7).result()
    ref = ref_session.training_client.save_weights_and_get_sampling_client()
    # engine 0 plays mazes 0-1 with seed 7, engine 1 maze 2 with chunk_seed(7, 1)
    expected = ref.play(play_episodes, MAZE, states[:2], 2, PARAMS, 7).result() + \
        ref.play(play_episodes, MAZE, states[2:], 2, PARAMS, chunk_seed(7, 1)).result()
    return got, expected


def test_colocated_workers_and_engines_share_bundles(dp_session) -> None:
    import ray

    names = dp_session.actor_names  # trainer-0, trainer-1, engine-0, engine-1
    assert actor_bundles(dp_session.placement_group) == {
        names[0]: 0, names[1]: 1, names[2]: 0, names[3]: 1}
    assert dp_session.plan.bundles == [{"CPU": 0.5}, {"CPU": 0.5}]
    pg = dp_session.placement_group.id.hex()
    free = ray.available_resources()
    assert [free.get(f"CPU_group_{i}_{pg}", 0.0) for i in range(2)] == [0.0, 0.0], free


def test_rollout_spreads_mazes_over_engines_in_maze_order(dp_session, rollouts) -> None:
    got, expected = rollouts

    def view(groups: list) -> list:
        return [[(ep.init_state, ep.replies, ep.positions, ep.reward) for ep in g] for g in groups]
    assert view(got) == view(expected)
    sync = dp_session.syncs[0]
    assert (sync.version, sync.engines) == (0, 2) and sync.bytes > 0 and sync.seconds > 0
    assert sync.method == "colocated" and sync.bytes == dp_session.trainable_bytes


def test_a_second_task_plays_on_the_engines_unchanged(dp_session, ref_session, rollouts) -> None:
    """The room (envs/room.py) through the Ray engines: the same episodes as in-process, with
    no code for it in the session, the actors or the loop."""
    from workbench.envs.room import RoomConfig, room_states

    task, states = RoomConfig(size=5, max_turns=3), room_states(5, 0, 3)
    got = dp_session.training_client.save_weights_and_get_sampling_client().play(
        play_episodes, task, states, 2, PARAMS, 5).result()
    ref = ref_session.training_client.save_weights_and_get_sampling_client()
    expected = ref.play(play_episodes, task, states[:2], 2, PARAMS, 5).result() + \
        ref.play(play_episodes, task, states[2:], 2, PARAMS, chunk_seed(5, 1)).result()
    assert [[(ep.init_state, ep.replies, ep.positions) for ep in g] for g in got] == \
        [[(ep.init_state, ep.replies, ep.positions) for ep in g] for g in expected]


def test_two_workers_make_the_same_update_as_one(dp_session, ref_session, rollouts) -> None:
    import ray

    episodes = [ep for group in rollouts[0] for ep in group]
    datums = [datum_from_stream(ep.stream, a) for ep, a in zip(episodes, itertools.cycle(
        [1.0, -0.5, 0.25]))]
    datums = global_weights(datums, "sequence_mean")  # as phases.update does
    # Adam's first step is lr * g / (|g| + eps): for an entry g near zero, a rounding difference
    # in g moves the step by up to lr * dg / eps. eps 1e-6 (not 1e-8) keeps that below the
    # tolerance, so the comparison measures the gradients, not Adam's conditioning.
    loss_cfg = LossConfig(reduction="sum")
    adam = AdamParams(learning_rate=1e-3, eps=1e-6)
    outs = []
    for session in (dp_session, ref_session):
        tc = session.training_client
        fb = tc.forward_backward(datums, "ppo", loss_cfg)  # both queued before either is awaited
        opt = tc.optim_step(adam)
        outs.append((fb.result(), opt.result()))
    (fb2, opt2), (fb1, opt1) = outs
    assert fb2.loss == pytest.approx(fb1.loss, rel=1e-5, abs=1e-7)
    assert fb2.metrics["tokens"] == fb1.metrics["tokens"]
    for key in ("kl_sampler_trainer", "clip_fraction", "entropy"):
        assert fb2.metrics[key] == pytest.approx(fb1.metrics[key], rel=1e-5, abs=1e-7), key
    assert len(fb2.logprobs_B_T) == len(datums)
    for a, b in zip(fb2.logprobs_B_T, fb1.logprobs_B_T):  # original datum order
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    assert opt2.grad_norm == pytest.approx(opt1.grad_norm, rel=1e-5)  # the all-reduced gradient
    rank0, rank1 = ray.get([w.snapshot.remote() for w in dp_session.trainers])
    one = snapshot(ref_session.host)
    assert rank0[0] == rank1[0] == 1  # weights version after one step
    assert all(torch.equal(rank0[1][k], rank1[1][k]) for k in one), "replicas diverged"
    moved = [k for k in one if "lora_B" in k and bool(one[k].abs().max() > 0)]
    assert moved, "the update moved no LoRA B matrix"
    worst = max(float((rank0[1][k] - one[k]).abs().max()) for k in one)
    assert worst < 1e-5, worst



def test_weight_broadcast_installs_rank0s_weights_on_every_engine(dp_session, rollouts) -> None:
    """open_weight_broadcast: later syncs are one gloo broadcast (NCCL on GPUs) from trainer
    rank 0 to the engines, which install exactly rank 0's tensors and sample from them."""
    import ray

    dp_session.open_weight_broadcast()
    sampler = dp_session.training_client.save_weights_and_get_sampling_client()
    version, want = ray.get(dp_session.trainers[0].snapshot.remote())
    sync = dp_session.syncs[-1]
    assert (sync.method, sync.version, sync.engines) == ("broadcast", version, 2)
    assert sync.bytes == dp_session.trainable_bytes and sync.seconds > 0
    for engine in dp_session.engines:
        got = ray.get(engine.call.remote(operator.attrgetter("versions")))[version]
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    episodes = sampler.play(play_episodes, MAZE, eval_set(5, 2), 1, PARAMS, seed=3).result()
    assert [len(g) for g in episodes] == [1, 1]


def test_actors_get_the_threads_and_trainer_switches_asked_for(local_ray, tiny_dir: Path,
                                                               tmp_path: Path) -> None:
    import ray

    speed = SpeedSettings(gradient_checkpointing=True, loss_tokens_only=True)
    cluster = ClusterSpec("local", num_workers=1, num_engines=1, colocate_all=True,
                          threads_per_actor=2)
    session = create_ray_session(SessionSpec(str(tiny_dir), LORA, str(tmp_path), speed=speed,
                                             cluster=cluster))
    try:
        actors = session.trainers + session.engines
        assert ray.get([a.threads.remote() for a in actors]) == [2, 2]  # Ray's default: 1
        switches = operator.attrgetter("speed.loss_tokens_only",
                                       "lm.model.is_gradient_checkpointing")
        assert ray.get(session.trainers[0].call.remote(switches)) == (True, True)
    finally:
        session.close()
