"""Shared fixtures: the tiny Qwen3-VL and the pretrained tiny policy (tiny-sft), built once per
session into a temporary cache, and a short SFT of the tiny base that the training-loop tests
(in-process and Ray) start from."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from workbench.runfolder import RunFolder
    from workbench.storage import Store

# Ray reads these when it is first imported, and any test may import it first (importorskip):
# a local Ray instance binds to 127.0.0.1 only, and reports no usage stats.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session", autouse=True)
def workbench_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """$WORKBENCH_CACHE points at a temp dir of this test run, so no test touches ~/.cache.
    The pytest-xdist workers of `make test` share it: the first to need tiny-sft builds it, and
    the other waits on the build's lock (model/tiny.py, build_atomically) instead of repeating
    it. WORKBENCH_TEST_CACHE=<folder> keeps one cache across test runs instead (the folders are
    named by the hash of what built them, so a changed recipe builds anew)."""
    if os.environ.get("WORKBENCH_TEST_CACHE"):
        root = Path(os.environ["WORKBENCH_TEST_CACHE"])
        root.mkdir(parents=True, exist_ok=True)
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "workbench-cache"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("workbench-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORKBENCH_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def tiny_dir(workbench_cache: Path) -> Path:
    """The tiny default's checkpoint folder, built once under the session cache."""
    from workbench.model import tiny_path

    return tiny_path()


@pytest.fixture(scope="session")
def tiny_sft_dir(workbench_cache: Path) -> Path:
    """The pretrained tiny policy (the default model.name), built once per session under the
    session cache exactly as a user's first `load_model("tiny-sft")` builds it (~5 min)."""
    from workbench.rl.pretrained import tiny_sft_path

    return tiny_sft_path()


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path):
    """The tiny default loaded from its folder (a LoadedModel; do not mutate its weights)."""
    from workbench.model import load_model

    return load_model(str(tiny_dir))


# The small run settings of the loop tests (test_train.py, test_ray_local.py): 7x7 mazes (5x5
# has no held-out training maze) with a short turn budget; tiny-sft solves some of them.
SMALL_RUN = [
    "env.size=7", "generator.max_turns=10", "generator.max_tokens=2",
    "generator.n_samples_per_prompt=4", "trainer.train_batch_size=3", "lora.rank=4",
    "lora.alpha=8", "eval.n_mazes=8", "eval.sampled_passes=1", "algorithm.minibatch=8",
    "env.format_weight=0.5",
]


@pytest.fixture(scope="session")
def sft_model(tiny_sft_dir: Path) -> str:
    """The policy the loop tests start from: the pretrained tiny policy's folder."""
    return str(tiny_sft_dir)


@pytest.fixture(scope="session")
def small_run() -> list[str]:
    """The small run settings as overrides (5x5 mazes, 3 x 4 episodes, LoRA 4)."""
    return list(SMALL_RUN)


# ------------------------------------------------------------------ S3 and adapters (serving)
# Test credentials: distinctive strings that the storage tests search for in errors/manifests.
S3_KEY_ID = "AKIAWORKBENCHTESTKEY7"
S3_SECRET = "wb-test-secret-9f3c1d7e5a"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 server (its real HTTP server, not a patched client) on 127.0.0.1 and a free
    port, with test credentials in the environment; yields the endpoint URL."""
    import logging
    import socket

    moto_server = pytest.importorskip("moto.server", reason="needs moto[server] (dev extra)")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    none = tmp_path_factory.mktemp("aws") / "none"
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", S3_KEY_ID)
        mp.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", str(none))  # never the machine's ~/.aws
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(none))
        yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A new empty bucket on the test server: s3://<name>."""
    import uuid

    import boto3

    name = f"wb-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> dict[str, Path]:
    """Exported PEFT adapters (LoRA r4, B set to random values so each answers differently):
    a0, a1, a2 on the tiny default, and `foreign` on a tiny built with another seed. Each sits
    in <run>/exports/global_step_N beside a fake eval/step_N.json."""
    import json

    import torch

    from workbench.model import LoraSettings, TinySpec, tiny_path
    from workbench.session import SessionSpec, create_session

    root, out = tmp_path_factory.mktemp("adapters"), {}
    bases = {"a0": tiny_dir, "a1": tiny_dir, "a2": tiny_dir, "foreign": tiny_path(TinySpec(seed=1))}
    for step, (name, base) in enumerate(bases.items(), start=1):
        session = create_session(SessionSpec(str(base), LoraSettings(rank=4, alpha=8),
                                             workdir=str(root / name)))
        gen = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for key, p in session.host.trainable().items():
                if "lora_B" in key:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        out[name] = Path(session.training_client.export(
            root / name / "exports" / f"global_step_{step}", "adapter").result())
        session.close()
        result = {"policy": name, "mode": "greedy", "n_mazes": 4, "episodes_per_maze": 1,
                  "successes_P": [1, 0, 0, step % 2], "mean_turns": 5.0, "mean_reward": 0.25,
                  "ceiling": 4}
        (root / name / "eval").mkdir()
        (root / name / "eval" / f"step_{step:06d}.json").write_text(
            json.dumps({"step": step, "results": [result]}))
    return out


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    """A storage root, once as a local folder and once under a nested prefix on moto's S3."""
    from workbench import storage

    if request.param == "local":
        return storage.open_store(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    return storage.open_store(f"{bucket}/some/prefix", request.getfixturevalue("s3_server"))


# A run at a `store` (the run-folder tests run on a local folder and on an S3 prefix alike).


def run_overrides(store: Store, tmp_path: Path) -> list[str]:
    """The overrides that put a run at `store`: run_dir, and for S3 its endpoint and its
    working copy (tmp_path / "wc")."""
    s3 = [f"storage.endpoint_url={store.endpoint_url}", f"storage.local_dir={tmp_path / 'wc'}"]
    return [f"run_dir={store.root}", *(s3 if store.s3 else [])]


def moved(run_dir: str | Path, store: Store, tmp_path: Path) -> str:
    """The allowed changes a resume logs for a run trained at the local run_dir and resumed at
    `store` (run_overrides), e.g. 'run_dir "/tmp/a" -> "/tmp/b"'."""
    s3 = [f'storage.endpoint_url "" -> "{store.endpoint_url}"',
          f'storage.local_dir "" -> "{tmp_path / "wc"}"']
    return ", ".join([f'run_dir "{run_dir}" -> "{store.root}"', *(s3 if store.s3 else [])])


def run_folder(store: Store, tmp_path: Path) -> RunFolder:
    """The runfolder.RunFolder of a run at `store` (run_overrides): the folder itself, or the
    S3 prefix with its working copy."""
    from workbench.runfolder import RunFolder, local_run

    return RunFolder(store, tmp_path / "wc") if store.s3 else local_run(store.root)


def place_run(folder: Path, store: Store, tmp_path: Path) -> RunFolder:
    """A copy of the run folder `folder` at `store`: copied into a local one, or uploaded to S3
    as training mirrors it (checkpoint folders whole, COMPLETE last). Returns its RunFolder."""
    import shutil
    from dataclasses import replace

    from workbench.config import RunConfig
    from workbench.runfolder import mirror_run

    if not store.s3:
        shutil.copytree(folder, store.root, dirs_exist_ok=True)
        return run_folder(store, tmp_path)
    stage = tmp_path / "upload"  # mirror_run records what it sent there: a copy of its own
    shutil.copytree(folder, stage)
    config = RunConfig()
    mirror_run(stage, replace(config, run_dir=store.root,
                              storage=replace(config.storage, endpoint_url=store.endpoint_url)))
    shutil.rmtree(stage)
    return run_folder(store, tmp_path)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A kernelspec named workbench-test for this interpreter on a temporary JUPYTER_PATH
    (searched first), so a clean clone needs nothing registered: the notebooks' and viewers'
    kernel tests."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name="workbench-test", display_name="Python (workbench test)",
            prefix=str(prefix))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
        yield "workbench-test"


# ------------------------------------------------------------------ test tiers (markers)
# `make test` runs everything; `make test-fast` deselects slow, ray, notebook, browser and gpu
# (the inner loop, under 3 min on 2 cores). Markers are assigned here, not in the test files:
#   slow      a test that takes > ~5 s on a 2-core CPU machine, or needs the tiny-sft build
#   ray       starts Ray (ray.init, `ray start`, Ray Serve)
#   notebook  runs a notebook (papermill kernel or JupyterLab)
#   browser   drives chromium through Playwright
#   gpu       the GPU code paths (CUDA-only tests skip on the CPU)
# Measured with `pytest --durations=0` per module. A module not listed is fast.
MODULE_MARKERS: dict[str, tuple[str, ...]] = {
    "test_checkpoints": ("slow",),  # every test needs its 2-step training run (module fixture)
    "test_demo": ("slow",),  # the demo end to end, from tiny-sft
    "test_gpu_paths": ("gpu",),  # GPU paths checked on CPU (the small shape; 63 s in all)
    "test_notebooks": ("notebook", "slow"),  # papermill runs, from tiny-sft
    "test_pretrained": ("slow",),  # the tiny-sft build (~5 min)
    "test_reprs": ("slow",),  # its module fixture plays a real tiny rollout (~10 s)
    "test_ray_local": ("ray", "slow"),  # ray.init with 2 CPUs, runs from tiny-sft
    "test_ray_remote": ("ray", "slow"),  # `ray start --head`, jobs from tiny-sft
    "test_run_folder": ("slow",),  # most tests copy its 2-step training run (module fixture)
    "test_serve_hostile": ("slow",),  # a served corpus of 200+ requests, a 429 / 504 server
    "test_service": ("slow",),  # the session server on tiny-sft, driven by the tinker SDK
    "test_service_hostile": ("slow",),  # session-server processes, a corpus, a crash
    "test_cookbook": ("slow",),  # tinker-cookbook's venv (built once, ~1.5 min) and a recipe
    "test_spec": ("slow",),  # most tests read its 1-step training run (module fixture)
    "test_train": ("slow",),  # training runs from tiny-sft, killed and resumed
}

# Per-test overrides, "module::function" (every parametrization): these markers REPLACE the
# module's (an empty tuple makes a test of a slow module fast).
TEST_MARKERS: dict[str, tuple[str, ...]] = {
    "test_cluster::test_connect_environment_binds_loopback_and_uses_a_token_when_there":
        ("slow",),  # two Python subprocesses, 6 s
    "test_cluster::test_fsdp_worker_shards_the_frozen_base_and_updates_like_one_device": ("gpu",),
    "test_demo::test_seed_table_lines": (),
    "test_benchmarks::test_the_update_probe_times_and_traces_an_update_call_on_the_cpu":
        ("slow",),  # 15 update calls of the tiny model, 12 s
    "test_benchmarks::test_the_gpu_paths_runner_judges_a_path_and_prints_its_table":
        ("slow",),  # two `python -m workbench train` starts, 20 s
    "test_benchmarks::test_the_service_overhead_benchmark_runs_one_loop_both_ways":
        ("slow",),  # tiny-sft in-process, then behind the session server
    "test_benchmarks::test_side_by_side_runs_each_backend_as_its_own_process_and_tables_the_ratio":
        ("ray", "slow"),  # two benchmark processes, one starting a local Ray, 45 s
    "test_errors::test_steps_without_an_update_log_no_loss_and_say_why_once":
        ("slow",),  # a real 2-step run, 6 s
    "test_errors::test_a_cached_hub_id_loads_offline_and_without_the_hub": ("slow",),  # 5 s
    "test_gpu_paths::test_static_pool_decode_matches_the_eager_sampler": ("gpu", "slow"),  # 31 s
    "test_gpu_paths::test_fused_decode_matches_the_eager_sampler": ("gpu", "slow"),  # 8 s + 4 s
    "test_gpu_paths::test_selective_checkpointing_keeps_the_gradients": ("gpu", "slow"),  # 5 s
    "test_gpu_paths::test_lora_in_model_dtype_keeps_the_gradients": ("gpu", "slow"),  # 5 s
    "test_notebooks::test_notebook_is_clean_and_has_its_parameters_cell": (),
    "test_notebooks::test_every_notebook_is_listed": (),
    "test_notebooks::test_06_serve_on_local_ray": ("notebook", "ray", "slow"),
    "test_notebooks::test_07_session_api_on_local_ray": ("notebook", "ray", "slow"),
    "test_service::test_the_server_runs_a_ray_session_with_two_users_as_in_process":
        ("ray", "slow"),
    "test_notebooks::test_trajectory_player_in_a_real_browser": ("notebook", "browser", "slow"),
    "test_notebooks::test_saved_notebook_without_a_kernel_in_a_real_browser":
        ("notebook", "browser", "slow"),  # nbclient, JupyterLab and chromium, no model
    "test_registry::test_eval_straight_from_s3": ("slow",),  # 9 s
    "test_run_folder::test_latest_starts_fresh_over_what_a_start_writes_first": (),
    "test_run_folder::test_sft_refuses_a_run_folder_unless_sft_overwrite": (),
    "test_run_folder::test_intervals_of_n": (),
    "test_run_folder::test_intervals_of_zero_mean_never": (),
    "test_run_folder::test_s3_prefix_is_not_cleared_unasked": (),
    "test_run_folder::test_s3_resume_skips_a_damaged_checkpoint": (),
    "test_serve_hostile::test_the_text_bound_never_claims_more_tokens_than_the_tokenizer_makes":
        (),
    "test_serve_hostile::test_no_text_bound_where_none_is_proven": (),
    "test_serve_parity::test_vllm_serves_as_trained": ("gpu",),
    "test_spec::test_a_spec_round_trips_through_its_file": (),
    "test_storage::test_run_dir_on_s3_is_mirrored_and_resumed_from_s3": ("slow",),  # 20 s
    "test_tasks::test_room_plays_through_the_session_and_the_phases": ("slow",),  # 25 s
    "test_tasks::test_room_trains_and_evaluates_from_the_command_line": ("slow",),  # 23 s
    "test_vllm_engine::test_real_vllm_matches_the_trainer": ("gpu",),
    "test_vllm_engine::test_real_vllm_samples_each_weight_version": ("gpu",),
    "test_fp8::test_fp8_base_compiled_equals_eager_on_cuda": ("gpu",),
    "test_viz::test_executed_notebook_html_shows_the_player_without_javascript":
        ("notebook", "slow"),  # a kernel and nbconvert, 7 s
}

# Added to any test that requests these fixtures (directly or through another fixture), in
# whichever module: a new test on tiny-sft can never land in the fast tier.
FIXTURE_MARKERS: dict[str, tuple[str, ...]] = {
    "tiny_sft_dir": ("slow",),  # the pretrained tiny policy, built once per session (~5 min)
    "live_server": ("ray", "slow"),  # `python -m workbench serve` on Ray Serve
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        module = item.path.stem
        name = getattr(item, "originalname", item.name)
        markers = set(TEST_MARKERS.get(f"{module}::{name}", MODULE_MARKERS.get(module, ())))
        for fixture in getattr(item, "fixturenames", ()):
            markers.update(FIXTURE_MARKERS.get(fixture, ()))
        for marker in sorted(markers):
            item.add_marker(marker)
        if "ray" in markers and not in_ray_unit(item.nodeid):
            raise pytest.UsageError(f"{item.nodeid} starts Ray but is not in RAY_UNIT "
                                    "(tests/conftest.py): add its module or name there")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=xdist_order(items))


def xdist_order(items: list[pytest.Item]) -> Callable[[pytest.Item], tuple[bool, bool]]:
    """The sort key of the workers' order: the Ray unit first (the longest to run), its tests
    without tiny-sft leading; then the modules that need tiny-sft, so the other worker builds
    it (~5 min) while the Ray unit runs the tests that need none, instead of one worker waiting
    on the other's build lock."""
    def needs_sft(test: pytest.Item) -> bool:
        return "tiny_sft_dir" in getattr(test, "fixturenames", ())

    sft_modules = {t.path for t in items if needs_sft(t) and not in_ray_unit(t.nodeid)}
    return lambda item: ((False, needs_sft(item)) if in_ray_unit(item.nodeid)
                         else (True, item.path not in sft_modules))


# ------------------------------------------------------------------ two workers (pytest-xdist)
# `make test` runs two pytest-xdist workers. Every test that starts Ray runs on one worker, in
# turn (two Ray instances at once would meet on the fixed ports: dashboard, Ray Client); each
# other module goes to a worker whole, so its module fixtures run once. The scheduler sees only
# test ids, so the Ray unit is named here; collection checks it holds every `ray` test.
RAY_UNIT = ("test_ray_local.py", "test_ray_remote.py", "test_serve.py",
            "test_notebooks.py::test_06_serve_on_local_ray",
            "test_notebooks.py::test_07_session_api_on_local_ray",
            "test_service.py::test_the_server_runs_a_ray_session_with_two_users_as_in_process",
            "test_benchmarks.py::test_side_by_side_runs_each_backend_as_its_own_process_and_"
            "tables_the_ratio")


def in_ray_unit(nodeid: str) -> bool:
    """Whether a test id ("tests/test_x.py::test_y[param]") belongs to the Ray unit."""
    module, _, name = nodeid.rpartition("/")[2].partition("::")
    return module in RAY_UNIT or f"{module}::{name.split('[')[0]}" in RAY_UNIT


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, only called under `pytest -n N`
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class RayOnOneWorker(LoadScopeScheduling):
        """Work units: "ray" (sent first, as collected), else the test's module."""

        def _split_scope(self, nodeid: str) -> str:
            return "ray" if in_ray_unit(nodeid) else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # keep the collection's order: the Ray unit first
    return RayOnOneWorker(config, log)


def _short_temp_dir() -> Iterator[Path]:
    """A short folder for a Ray instance's session files, removed afterwards: Ray's sockets live
    in it, and a socket path ends at 107 bytes (a pytest temp folder under an xdist worker's,
    /tmp/pytest-of-USER/pytest-N/popen-gwK/..., is too long)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="wb-ray-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_temp_dir() -> Iterator[Path]:
    """The module's Ray instance's folder (`_short_temp_dir`)."""
    yield from _short_temp_dir()


@pytest.fixture
def another_ray_temp_dir() -> Iterator[Path]:
    """A test's own second Ray instance's folder (`_short_temp_dir`)."""
    yield from _short_temp_dir()


def export_adapter(base: Path, folder: Path, lora: Any, seed: int) -> Path:
    """Export a LoRA adapter `lora` (a LoraSettings) on `base` with B drawn at random (scale 0.5,
    `seed`), so it answers unlike the base; its session works in `folder`."""
    import torch

    from workbench.session import SessionSpec, create_session

    session = create_session(SessionSpec(str(base), lora, workdir=str(folder)))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in session.host.trainable().items():
            if "lora_B" in key:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    path = Path(session.training_client.export(folder / "exports" / f"global_step_{seed}",
                                               "adapter").result())
    session.close()
    return path


# ------------------------------------------------------------ an endpoint in its own process


def wait_ready(proc: Any, base_url: str, log: Path, key: str, timeout_s: float,
               every_s: float) -> None:
    """Until `GET <base_url>/models` answers 200 with the key; fails with the log's tail when
    the process exits first or `timeout_s` passes."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            r = httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {key}"})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(every_s)
    pytest.fail(f"serve not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop_process(proc: Any, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL when it has not exited after `timeout_s`."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
