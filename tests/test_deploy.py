"""deploy/ agrees with what the workbench relies on: the GPU image (deploy/Dockerfile and its
lock), the KubeRay RayCluster and RayJob, and the shared volume's claim.

The files are parsed here (PyYAML, the Dockerfile's instructions) and compared with exact
values: the lock files, pyproject's extras and the project's own config parser. No image is
built and no manifest is applied (no Docker, no Kubernetes on the test machines). Each check is
a function over the parsed documents, so the last test shows it fails on a broken copy.
"""

from __future__ import annotations

import copy
import importlib.util
import re
import shlex
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from workbench import cli
from workbench.cluster.placement import plan_placement
from workbench.config import PRESETS, apply_overrides, flat_keys

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
GPU = "nvidia.com/gpu"
HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}  # KubeRay's names


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _one(name: str, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs(name) if d["kind"] == kind]
    return doc


def _pins(lock: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / lock).read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            pins[req.name.lower().replace("_", "-")] = str(req.specifier).removeprefix("==")
    return pins


def _project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _lock_gpu_module() -> Any:
    spec = importlib.util.spec_from_file_location("lock_gpu", DEPLOY / "lock_gpu.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
            pending = ""
    return out


DOCKERFILE = dockerfile((DEPLOY / "Dockerfile").read_text())
ARGS = dict(a.split("=", 1) for i, a in DOCKERFILE if i == "ARG")
RUNS = [a.replace("${PYTHON_VERSION}", ARGS["PYTHON_VERSION"]) for i, a in DOCKERFILE
        if i == "RUN"]
RAY_VERSION = str(Requirement(_project()["optional-dependencies"]["ray"][0]).specifier)[2:]


def containers(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{"head" | worker group name: its Ray container (the first)}."""
    spec = cluster["spec"]
    groups = {"head": spec["headGroupSpec"]} | {g["groupName"]: g
                                                for g in spec["workerGroupSpecs"]}
    return {name: g["template"]["spec"]["containers"][0] for name, g in groups.items()}


def pod_specs(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = cluster["spec"]
    return {"head": spec["headGroupSpec"]["template"]["spec"]} | {
        g["groupName"]: g["template"]["spec"] for g in spec["workerGroupSpecs"]}


def job_config(job: dict[str, Any]) -> tuple[str, Any]:
    """The RayJob's entrypoint through the CLI's own parser and config: (preset, RunConfig)."""
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "workbench"], argv
    args, extra = cli.build_parser().parse_known_args(argv[3:])
    assert args.command == "train" and not extra, argv
    return args.preset, apply_overrides(PRESETS[args.preset], args.overrides)


# ------------------------------------------------------------------ checks over the documents


def check_ray_version(cluster: dict[str, Any], ray: str) -> None:
    assert cluster["spec"]["rayVersion"] == ray
    for name, c in containers(cluster).items():
        tag = c["image"].rsplit(":", 1)[1]
        assert re.search(rf"-ray{re.escape(ray)}-", tag), (name, tag, ray)


def check_head(cluster: dict[str, Any]) -> None:
    head = containers(cluster)["head"]
    assert {p["name"]: p["containerPort"] for p in head["ports"]} == HEAD_PORTS
    params = cluster["spec"]["headGroupSpec"]["rayStartParams"]
    assert params["dashboard-host"] == "0.0.0.0" and params["num-gpus"] == "0"
    assert GPU not in head["resources"]["limits"]
    for group in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]:
        bad = {k: v for k, v in group["rayStartParams"].items() if not isinstance(v, str)}
        assert not bad, f"rayStartParams must be strings: {bad}"


def check_gpu_workers(cluster: dict[str, Any]) -> None:
    (group,) = cluster["spec"]["workerGroupSpecs"]
    res = containers(cluster)[group["groupName"]]["resources"]
    assert res["requests"][GPU] == res["limits"][GPU] == "1", res
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["rayStartParams"].get("num-gpus", res["limits"][GPU]) == res["limits"][GPU]


def check_run_folder(cluster: dict[str, Any], claim: dict[str, Any], job: dict[str, Any]) -> None:
    """One claim, mounted at one path in every pod; the job's run_dir and HF_HOME under it."""
    mounts = set()
    for name, pod in pod_specs(cluster).items():
        (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"], name
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"]
                    if m["name"] == volume["name"]]
        mounts.add(mount["mountPath"])
        env = {e["name"]: e.get("value") for e in pod["containers"][0].get("env", [])}
        assert env["HF_HOME"].startswith(mount["mountPath"] + "/"), (name, env)
    assert len(mounts) == 1, f"the run folder is mounted at {sorted(mounts)}"
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    run_dir = job_config(job)[1].run_dir
    assert run_dir.startswith(mounts.pop() + "/"), run_dir


def check_job_selects_cluster(cluster: dict[str, Any], job: dict[str, Any]) -> None:
    spec = job["spec"]
    assert spec["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    # What KubeRay refuses, or what a long-lived cluster breaks, with a clusterSelector:
    assert "rayClusterSpec" not in spec and "jobId" not in spec
    assert spec.get("backoffLimit", 0) == 0 and spec["submissionMode"] == "K8sJobMode"
    assert "working_dir" not in yaml.safe_load(spec.get("runtimeEnvYAML", "{}"))


CLUSTER = _one("raycluster.yaml", "RayCluster")
JOB = _one("rayjob.yaml", "RayJob")
CLAIM = _one("fsx-pvc.yaml", "PersistentVolumeClaim")


# ------------------------------------------------------------------------------ the image


def test_image_pins_are_the_gpu_extra_and_the_locks() -> None:
    gpu, cpu = _pins("lock-gpu.txt"), _pins("lock-cpu.txt")
    extras = _project()["optional-dependencies"]
    assert extras["gpu"] == [f"vllm=={gpu['vllm']}"] and gpu["vllm"] == "0.26.0"
    assert gpu["ray"] == cpu["ray"] == RAY_VERSION == "2.60.0"
    # vLLM 0.26.0's own pins (torch 2.11.0 is the build with CUDA 13.0 wheels)
    assert (gpu["torch"], gpu["torchvision"]) == ("2.11.0", "0.26.0")
    assert gpu["nvidia-cuda-runtime"].startswith("13.0.")
    for name in ("transformers", "peft", "tokenizers", "safetensors", "accelerate", "boto3",
                 "gymnasium", "pillow", "huggingface-hub"):
        assert gpu[name] == cpu[name], (name, gpu[name], cpu[name])


def test_gpu_lock_leaves_the_cpu_lock_only_where_vllm_pins_otherwise() -> None:
    gpu, cpu = _pins("lock-gpu.txt"), _pins("lock-cpu.txt")
    lock_gpu = _lock_gpu_module()
    differ = {n for n in gpu.keys() & cpu.keys() if gpu[n] != cpu[n]
              and not n.startswith(lock_gpu.CUDA_STACK)}
    assert differ == set(lock_gpu.RELAXED)  # a stale RELAXED entry fails too


def test_gpu_lock_satisfies_pyproject() -> None:
    gpu, project = _pins("lock-gpu.txt"), _project()
    lock_gpu = _lock_gpu_module()
    reqs = project["dependencies"] + [r for e in lock_gpu.EXTRAS
                                      for r in project["optional-dependencies"][e]]
    for req in map(Requirement, reqs):
        name = req.name.lower()
        assert name in gpu and req.specifier.contains(gpu[name]), (name, gpu.get(name))


def test_image_installs_the_workbench_with_the_gpu_lock() -> None:
    extras = ",".join(_lock_gpu_module().EXTRAS)
    assert any(re.search(r"pip install .*-r requirements/lock-gpu\.txt", r) for r in RUNS)
    assert any(f'pip install --no-cache-dir -c requirements/lock-gpu.txt ".[{extras}]"' in r
               for r in RUNS), RUNS
    assert not [r for r in RUNS if re.search(r"\b[\w.-]+==\d", r)], "a pin outside the lock"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    copied = [a.split()[:-1] for i, a in DOCKERFILE if i == "COPY"]
    assert [src for c in copied for src in c if f"!{src}" not in ignore] == []


def test_image_python_and_cuda_match_the_tag_and_the_notebooks() -> None:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    python = ARGS["PYTHON_VERSION"]
    assert f"python={python}" in env["dependencies"]
    assert f"(Python {python}," in (ROOT / "requirements/lock-cpu.txt").read_text()
    assert _lock_gpu_module().PYTHON == python
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-base-ubuntu24\.04", ARGS["CUDA_IMAGE"])
    runtime = _pins("lock-gpu.txt")["nvidia-cuda-runtime"].split(".")
    assert cuda and list(cuda.groups()) == runtime[:2], (ARGS["CUDA_IMAGE"], runtime)
    tag = f"{_project()['version']}-ray{RAY_VERSION}-py{python.replace('.', '')}" \
          f"-cu{''.join(runtime[:2])}"
    assert tag == "0.1.0-ray2.60.0-py311-cu130"
    assert {c["image"].rsplit(":", 1)[1] for c in containers(CLUSTER).values()} == {tag}


def test_image_has_what_kuberay_needs() -> None:
    python = ARGS["PYTHON_VERSION"]
    apt = next(r for r in RUNS if "apt-get install" in r and "wget" in r).split()
    assert {"bash", "wget", "grep", "build-essential", f"python{python}-dev",
            f"python{python}-venv"} <= set(apt)
    env = " ".join(a for i, a in DOCKERFILE if i == "ENV")
    assert "PATH=/opt/venv/bin:$PATH" in env and "RAY_USAGE_STATS_ENABLED=0" in env
    assert any(f"python{python} -m venv $VIRTUAL_ENV" in r for r in RUNS)
    assert any("ray --version" in r for r in RUNS)


# ------------------------------------------------------------------------- the manifests


def test_ray_version_of_the_manifests_is_the_locks() -> None:
    check_ray_version(CLUSTER, RAY_VERSION)


def test_head_exposes_the_ray_ports_and_takes_no_gpu() -> None:
    check_head(CLUSTER)


def test_gpu_workers_request_one_gpu_and_fit_the_seed_recipe() -> None:
    check_gpu_workers(CLUSTER)
    config = job_config(JOB)[1]
    c = config.cluster
    plan = plan_placement(c.num_workers, c.num_engines, c.colocate_all, use_gpu=True,
                          cpus_per_actor=c.cpus_per_actor)
    (group,) = CLUSTER["spec"]["workerGroupSpecs"]
    worker = containers(CLUSTER)[group["groupName"]]["resources"]["limits"]
    # one bundle per pod, all of them on the workers that are always up
    assert plan.bundles == [{"CPU": 1.0, "GPU": 1.0}]
    assert len(plan.bundles) <= group["minReplicas"]
    assert all(b["GPU"] <= float(worker[GPU]) and b["CPU"] <= float(worker["cpu"])
               for b in plan.bundles)


def test_run_folder_is_one_shared_path() -> None:
    check_run_folder(CLUSTER, CLAIM, JOB)
    storage_class = _one("fsx-pvc.yaml", "StorageClass")
    assert CLAIM["spec"]["storageClassName"] == storage_class["metadata"]["name"]
    assert storage_class["provisioner"] == "fsx.csi.aws.com"
    assert "flock" in storage_class["mountOptions"]


def test_auth_token_reaches_the_pods_from_one_secret() -> None:
    auth = CLUSTER["spec"]["authOptions"]
    assert auth == {"mode": "token", "secretName": "workbench-ray-token"}
    for c in containers(CLUSTER).values():  # KubeRay adds RAY_AUTH_*: nothing may override it
        assert not {e["name"] for e in c.get("env", [])} & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
    docs = (ROOT / "docs" / "ray.md").read_text()
    assert f"kubectl create secret generic {auth['secretName']}" in docs


def test_rayjob_entrypoint_is_the_seed_recipe_resuming_on_the_volume() -> None:
    preset, config = job_config(JOB)
    assert preset == "seed_gpu"
    seed, got = flat_keys(PRESETS["seed_gpu"]), flat_keys(config)
    assert {k: v for k, v in got.items() if seed[k] != v} == {
        "cluster.address": "auto", "run_dir": "/fsx/runs/seed_gpu"}
    # latest is the default too; the entrypoint says it, so a resubmission resumes whatever
    # the default becomes
    assert "trainer.resume_mode=latest" in shlex.split(JOB["spec"]["entrypoint"])
    assert config.trainer.resume_mode == "latest"


def test_rayjob_selects_the_raycluster() -> None:
    check_job_selects_cluster(CLUSTER, JOB)


def test_docs_name_the_manifests_service_and_ports() -> None:
    docs = (ROOT / "docs" / "ray.md").read_text()
    service = f"svc/{CLUSTER['metadata']['name']}-head-svc"
    assert f"kubectl port-forward {service} 10001:10001 8265:8265" in docs
    for name in ("Dockerfile", "raycluster.yaml", "rayjob.yaml", "fsx-pvc.yaml"):
        assert f"deploy/{name}" in docs, name
    assert 'RAY_ADDRESS = "ray://127.0.0.1:10001"' in docs


# ------------------------------------------------------------- the checks fail when broken


def _set(path: tuple[str | int, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    """A change at `path` (keys, list indexes), or its removal with value=None."""
    def change(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        if value is None:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return change


HEAD = ("spec", "headGroupSpec")
HEAD_C = (*HEAD, "template", "spec", "containers", 0)
WORKER = ("spec", "workerGroupSpecs", 0)
WORKER_C = (*WORKER, "template", "spec", "containers", 0)
OLD_RAY_IMAGE = "registry.example.com/workbench:0.1.0-ray2.59.0-py311-cu130"
BROKEN = {
    "rayVersion another Ray": ("cluster", _set(("spec", "rayVersion"), "2.59.0"),
                               check_ray_version),
    "worker image another Ray": ("cluster", _set((*WORKER_C, "image"), OLD_RAY_IMAGE),
                                 check_ray_version),
    "client port renamed": ("cluster", _set((*HEAD_C, "ports", 2, "name"), "ray-client"),
                            check_head),
    "dashboard port missing": ("cluster", _set((*HEAD_C, "ports", 1), None), check_head),
    "num-gpus as a number": ("cluster", _set((*HEAD, "rayStartParams", "num-gpus"), 0),
                             check_head),
    "gpu limit above request": ("cluster", _set((*WORKER_C, "resources", "limits", GPU), "2"),
                                check_gpu_workers),
    "gpu request missing": ("cluster", _set((*WORKER_C, "resources", "requests", GPU), None),
                            check_gpu_workers),
    "worker mounts elsewhere": ("cluster", _set((*WORKER_C, "volumeMounts", 0, "mountPath"),
                                                "/data"), check_run_folder),
    "another claim": ("cluster", _set((*WORKER, "template", "spec", "volumes", 0,
                                       "persistentVolumeClaim", "claimName"), "other"),
                      check_run_folder),
    "run_dir off the volume": ("job", _set(("spec", "entrypoint"), "python -m workbench train "
                                           "--preset seed_gpu run_dir=runs/seed_gpu"),
                               check_run_folder),
    "selector names another cluster": ("job", _set(("spec", "clusterSelector"),
                                                   {"ray.io/cluster": "other"}),
                                       check_job_selects_cluster),
    "a fixed jobId": ("job", _set(("spec", "jobId"), "seed"), check_job_selects_cluster),
}


def _run(check: Callable[..., None], cluster: dict[str, Any], job: dict[str, Any]) -> None:
    if check is check_ray_version:
        check(cluster, RAY_VERSION)
    elif check is check_run_folder:
        check(cluster, CLAIM, job)
    elif check is check_job_selects_cluster:
        check(cluster, job)
    else:
        check(cluster)


@pytest.mark.parametrize("what", list(BROKEN))
def test_each_check_fails_on_a_broken_copy(what: str) -> None:
    which, change, check = BROKEN[what]
    cluster, job = copy.deepcopy(CLUSTER), copy.deepcopy(JOB)
    _run(check, cluster, job)  # the real documents pass
    change(cluster if which == "cluster" else job)
    with pytest.raises((AssertionError, KeyError)):
        _run(check, cluster, job)
