"""The install files agree: environment.yml pins == the lock, and both satisfy pyproject."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements/lock-cpu.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            pins[req.name.lower()] = str(req.specifier).removeprefix("==")
    return pins


def _env_pins() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_list = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    reqs = [Requirement(x) for x in pip_list if not x.startswith("-")]
    return {r.name.lower(): str(r.specifier).removeprefix("==") for r in reqs}


def _pyproject_reqs() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    extra_reqs = [r for k in ("ray", "s3", "viz", "notebook", "serve", "service", "tensorboard",
                                "mlflow")
                  for r in extras[k]]
    names = project["dependencies"] + extra_reqs
    return [Requirement(r) for r in names]


def test_environment_yml_pins_equal_the_lock() -> None:
    lock, env = _lock(), _env_pins()
    assert env, "environment.yml lists no pip pins"
    for name, version in env.items():
        assert lock.get(name) == version, (name, version, lock.get(name))


def test_every_runtime_requirement_is_pinned_in_both_and_in_range() -> None:
    lock, env = _lock(), _env_pins()
    for req in _pyproject_reqs():
        name = req.name.lower()
        assert name in env, f"{name} missing from environment.yml"
        assert req.specifier.contains(lock[name], prereleases=True), (name, lock[name])


def test_gpu_extra_admits_vllm_pins() -> None:
    # The gpu extra pins the tested vLLM 0.26.0 (torch==2.11.0, torchvision==0.26.0,
    # transformers>=5.5.3); the core ranges admit it, and vLLM 0.33's torch==2.14.0 too.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["gpu"] == ["vllm==0.26.0"]
    core = {r.name: r.specifier for r in _pyproject_reqs()}
    for torch, vision in (("2.11.0", "0.26.0"), ("2.14.0", "0.29.0")):
        assert core["torch"].contains(torch) and core["torchvision"].contains(vision)
    assert core["transformers"].contains("5.17.0") and not core["transformers"].contains("5.21.0")


def test_installed_versions_match_the_lock() -> None:
    from importlib.metadata import version

    lock = _lock()
    for name in ("torch", "torchvision", "transformers", "peft", "numpy", "gymnasium"):
        assert version(name).split("+")[0] == lock[name], name


def test_core_imports_without_optional_packages() -> None:
    # The core must import where ray, boto3, ipywidgets, papermill, matplotlib are absent
    # (the GPU image lacks them): block them and import every core module in a fresh interpreter.
    code = (
        "import sys\n"
        "for m in ('ray', 'boto3', 'ipywidgets', 'papermill', 'matplotlib', 'vllm', 'fastapi'):\n"
        "    sys.modules[m] = None\n"
        "import workbench, workbench.envs, workbench.model, workbench.policy, workbench.rl\n"
        "import workbench.storage, workbench.registry, workbench.serve, workbench.cli\n"
        "from workbench.deps import require\n"
        "try:\n    require('ray')\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert re.search(r"pip install 'workbench\[ray\]'", out.stdout), out.stdout + out.stderr
