#!/usr/bin/env bash
# Build tests/.cookbook-venv: the official tinker-cookbook (0.5.8, with the math_rl recipe's
# extra) in a venv of its own, for tests/test_cookbook.py. Its own venv because the cookbook
# pins transformers <= 5.5.4 and the workbench 5.20.2; 0.6.1 needs tml-renderers >= 0.4.1,
# which the package index does not serve. torch: the CPU wheel where pip finds one (about
# 1.6 GB in all), else the lock's torch (about 6 GB). The SDK and the shared numeric stack are
# the lock's versions.
#
#     bash tests/cookbook_env.sh          # ~1.5 min on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=tests/.cookbook-venv
COOKBOOK="tinker-cookbook[math-rl]==0.5.8"

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
grep -E "^(numpy|pillow|safetensors|pydantic|protobuf|tinker)==" requirements/lock-cpu.txt \
    > "$VENV/constraints.txt"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
"$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" "torch==2.13.0+cpu" "$COOKBOOK" \
  || { grep -E "^torch==" requirements/lock-cpu.txt >> "$VENV/constraints.txt"
       "$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" torch "$COOKBOOK"; }
"$VENV/bin/python" -m pip check
"$VENV/bin/python" -c "import tinker, tinker_cookbook; print('tinker', tinker.__version__)"
