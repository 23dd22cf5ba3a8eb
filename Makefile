# The two commands a new machine needs: `make demo` and `make test`. Both run `make setup` first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup chromium test test-fast test-gpu demo demo-long bench bench-notebooks bench-scale bench-trl bench-gpu lint typecheck lab lock lock-gpu clean

setup: $(STAMP) chromium

# Debian's chromium for the notebooks' browser test (Playwright drives it; Playwright's own
# browser download fails here). Installed only as root where apt-get exists; otherwise the
# test skips and says why.
chromium:
	@test -x /usr/bin/chromium || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
	  >/dev/null; } \
	  || echo "chromium not installed: the notebook browser test will skip"

# Re-installs only when pyproject.toml or the lock changed; otherwise a no-op.
$(STAMP): pyproject.toml requirements/lock-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q -c requirements/lock-cpu.txt -e ".[all,dev]"
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check workbench tests benchmarks

# mypy over workbench/ ([tool.mypy] in pyproject.toml): zero errors.
typecheck: setup
	$(BIN)/mypy

# Two pytest-xdist workers: one runs the tests that start Ray in turn, the other the rest
# (tests/conftest.py, pytest_xdist_make_scheduler). `PYTEST_WORKERS=0` runs them in this process.
PYTEST_WORKERS ?= 2
test: setup lint typecheck
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS)

# The inner loop (under 3 min on 2 cores): the markers are assigned in tests/conftest.py.
test-fast: setup lint typecheck
	$(BIN)/python -m pytest -m "not slow and not ray and not notebook and not browser and not gpu"

# Every GPU path in one command (benchmarks/gpu_paths.py): each sampler mode on each executor
# (in-process, Ray started by the run, a driver over ray://), seed_gpu at the 8B shape in-process
# and on Ray, and `pytest -m gpu`; one table, in a 575 s budget on one H200. Runs on a CUDA
# machine whose python3 has vllm and ray (pip install '.[gpu,ray]'); not part of `make test`.
test-gpu:
	python3 -m benchmarks.gpu_paths --out runs/test-gpu

demo: setup
	$(BIN)/python -m workbench demo --out runs/demo

demo-long: setup
	$(BIN)/python -m workbench demo --out runs/demo-long --long

# The benchmarks (benchmarks/, run as `python -m benchmarks.NAME`; figures in
# benchmarks/RESULTS.md). Run each alone on the machine.
bench: setup
	$(BIN)/python -m benchmarks.bench

# Each notebook's wall time with its committed parameters, as CI runs it (budget: 30 s each).
bench-notebooks: setup
	$(BIN)/python -m benchmarks.notebooks

bench-scale: setup
	$(BIN)/python -m benchmarks.scale --out runs/bench/scale.json --plot docs/scale_cpu.png

bench-trl: setup
	bash benchmarks/trl_env.sh
	benchmarks/.trl-venv/bin/python -m benchmarks.trl_compare --plot docs/trl_compare.png
	benchmarks/.trl-venv/bin/python -m benchmarks.trl_multiturn --plot docs/trl_multiturn.png

# The product's GRPO step on a CUDA machine (the 8B shape, vLLM sampling, in-process).
bench-gpu:
	python3 -m benchmarks.gpu --out runs/bench/gpu.json

# JupyterLab over notebooks/ on this project's kernel (python3 resolves to .venv's python).
lab: setup
	$(BIN)/jupyter lab --ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

# Rebuild the lock from a fresh venv of the current pyproject (review the diff before committing).
lock:
	rm -rf /tmp/workbench-lock && $(PY) -m venv /tmp/workbench-lock
	/tmp/workbench-lock/bin/python -m pip install -q --upgrade "pip>=24"
	/tmp/workbench-lock/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1 ".[all,dev]"
	/tmp/workbench-lock/bin/python -m pip check
	{ echo "# Exact versions installed together on the CPU machine (Python 3.11, x86_64); pip check clean."; \
	  echo "# Regenerate with: make lock   (used as pip constraints by make setup)"; \
	  /tmp/workbench-lock/bin/python -m pip freeze --exclude-editable | grep -v "^workbench"; } > requirements/lock-cpu.txt

# The GPU image's lock (deploy/Dockerfile): pip resolves .[gpu,ray,s3] for CPython 3.11 on
# manylinux x86_64 against the CPU lock, downloading metadata only (about 1 min).
lock-gpu:
	$(PY) deploy/lock_gpu.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
