#!/usr/bin/env bash
# Build the H200 machine's second carry file: TRL and the packages it needs there, for
# benchmarks/trl_gpu.py. The H200 image (Python 3.12.3, torch 2.11.0, transformers 5.17.0, peft
# 0.21.0, accelerate, pandas, pyarrow, huggingface-hub, fsspec, xxhash, rich, ...) has no network;
# vLLM 0.26.0 comes from shared/gpu/gpu_site.tar.xz (with dill 0.4.1, xgrammar, llguidance), so
# this adds only what both lack: trl 1.16.0 (accepts vLLM 0.22-0.31), datasets (TRL's hard
# dependency; >=4.7.0), multiprocess (datasets'), and lm-format-enforcer 0.11.3 with interegular
# (vLLM 0.26 imports them to validate any structured-output request, whichever backend runs
# it; the vLLM bundle leaves them out). Pure-Python wheels for Python 3.12, unpacked
# as a site dir into one tar.xz (~1 MiB), to extract into the same folder as gpu_site.tar.xz.
#
#     bash benchmarks/trl_gpu_bundle.sh .carry/trl_site.tar.xz
set -euo pipefail
OUT=$(realpath -m "${1:?usage: trl_gpu_bundle.sh OUT.tar.xz}")
PKGS="trl==1.16.0 datasets==5.2.0 multiprocess==0.70.19 lm-format-enforcer==0.11.3 interegular==0.3.3"
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/whl" "$W/site"
for p in $PKGS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 -d "$W/whl" "$p"
done
for f in "$W"/whl/*.whl; do
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$f" "$W/site"
done
rm -rf "$W"/site/bin "$W"/site/*.data  # console scripts: not used
mkdir -p "$(dirname "$OUT")"
tar -C "$W/site" -cf - . | xz -9 -T1 > "$OUT"
ls "$W/whl"
ls -l "$OUT"
