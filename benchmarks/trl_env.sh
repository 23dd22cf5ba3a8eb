#!/usr/bin/env bash
# Build benchmarks/.trl-venv: TRL's GRPOTrainer beside the workbench, for benchmarks/trl_compare.py.
#
# A separate venv (no --system-site-packages) so TRL and its extra dependencies (datasets,
# pandas, pyarrow) never touch the project's .venv. The shared stack is pinned by the project's
# lock (requirements/lock-cpu.txt: torch 2.14.1 + torchvision 0.29.1 from this machine's disk,
# transformers 5.20.2, peft 0.21.2, accelerate 1.15.0), so both trainers run on the same
# torch/transformers build. TRL 1.16.0 requires transformers>=4.56.2, so it installs beside the
# lock's 5.20.2 with a clean `pip check`. The workbench is installed editable (core deps only).
#
#     bash benchmarks/trl_env.sh            # ~2-3 min, ~6 GB (the torch 2.14.1 wheel)
#     TRL_VERSION=1.16.0 PY=python3.11 bash benchmarks/trl_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=benchmarks/.trl-venv
TRL_VERSION=${TRL_VERSION:-1.16.0}

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade "pip>=24"
"$VENV/bin/python" -m pip install -q -c requirements/lock-cpu.txt \
    "trl==$TRL_VERSION" torch torchvision transformers peft accelerate matplotlib -e .
"$VENV/bin/python" -m pip check
"$VENV/bin/python" -m pip freeze --exclude-editable > "$VENV/freeze.txt"
"$VENV/bin/python" -c "import torch, transformers, peft, trl, accelerate, datasets; \
print('trl', trl.__version__, '| transformers', transformers.__version__, '| peft', \
peft.__version__, '| torch', torch.__version__, '| accelerate', accelerate.__version__, \
'| datasets', datasets.__version__)"
