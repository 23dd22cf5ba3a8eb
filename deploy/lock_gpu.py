"""Write requirements/lock-gpu.txt: the exact versions of the GPU image (deploy/Dockerfile).

    python deploy/lock_gpu.py        (or `make lock-gpu`; review the diff before committing)

pip's own resolver, asked for the image's platform (CPython 3.11, manylinux x86_64) without
installing anything: `pip install --dry-run --report` over the core dependencies and the `gpu`,
`ray` and `s3` extras, with requirements/lock-cpu.txt as constraints. So the GPU image keeps the
CPU lock's version of every package that vLLM 0.26.0 admits (transformers, peft, ray, ...) and
differs only where vLLM's own pins leave no choice (RELAXED below).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_LOCK = ROOT / "requirements" / "lock-cpu.txt"
GPU_LOCK = ROOT / "requirements" / "lock-gpu.txt"
EXTRAS = ("gpu", "ray", "s3")  # what the image installs: `pip install .[gpu,ray,s3]`
PYTHON = "3.11"  # the CPU lock's Python: Ray Client needs the same minor version on both sides

# The CUDA stack comes with vLLM's torch==2.11.0 (CUDA 13.0 wheels), not the CPU lock's 2.14.1.
CUDA_STACK = ("torch", "torchvision", "triton", "nvidia-", "cuda-")
RELAXED = {
    "fastapi": "vLLM 0.26.0 wants >=0.133,<0.137",
    "lark": "vLLM 0.26.0 pins 1.2.2",
    "protobuf": "nvidia-cutlass-dsl 4.6 (a vLLM dependency) wants <7",
    "numpy": "mistral-common (a vLLM dependency) wants <2.4 on Python <= 3.12",
}
"""CPU-lock pins that vLLM 0.26.0's dependencies rule out, with the reason (pip's conflict)."""


def requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return project["dependencies"] + [r for e in EXTRAS for r in extras[e]]


def constraints() -> list[str]:
    keep = []
    for line in CPU_LOCK.read_text().splitlines():
        name = line.split("==")[0].lower()
        if line and not line.startswith("#") and not name.startswith(CUDA_STACK) \
                and name not in RELAXED:
            keep.append(line)
    return keep


def resolve(reqs: list[str], cons: list[str]) -> dict[str, str]:
    """{name: version} of everything pip would install on the image's platform."""
    platforms = ["manylinux2014_x86_64", "linux_x86_64",
                 *(f"manylinux_2_{n}_x86_64" for n in range(5, 40))]  # Ubuntu 24.04: glibc 2.39
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "c.txt").write_text("\n".join(cons) + "\n")
        (Path(tmp) / "r.txt").write_text("\n".join(reqs) + "\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
             "--report", f"{tmp}/report.json", "--only-binary=:all:",
             "--python-version", PYTHON, "--implementation", "cp",
             "--abi", "cp" + PYTHON.replace(".", ""), "--abi", "abi3", "--abi", "none",
             *(a for p in platforms for a in ("--platform", p)),
             "-c", f"{tmp}/c.txt", "-r", f"{tmp}/r.txt"], check=True)
        report = json.loads((Path(tmp) / "report.json").read_text())
    return {i["metadata"]["name"]: i["metadata"]["version"] for i in report["install"]}


def main() -> None:
    pins = resolve(requirements(), constraints())
    header = [
        f"# Exact versions of the GPU image (deploy/Dockerfile): Python {PYTHON}, x86_64,",
        f"# `.[{','.join(EXTRAS)}]` resolved by pip with requirements/lock-cpu.txt as constraints.",
        "# Regenerate with: make lock-gpu   (deploy/lock_gpu.py says which CPU pins give way)",
    ]
    lines = [f"{name}=={pins[name]}" for name in sorted(pins, key=str.lower)]
    GPU_LOCK.write_text("\n".join(header + lines) + "\n")
    print(f"wrote {GPU_LOCK.relative_to(ROOT)}: {len(lines)} packages")


if __name__ == "__main__":
    main()
