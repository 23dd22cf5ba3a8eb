"""Wall time of every notebook with its committed parameters (only OUT_DIR passed), as CI runs
them: papermill on a kernel of this interpreter, kernel start included. Prints one line per
notebook and the median of `--repeats` runs, flagging any over its 30 s budget on 2 cores;
exits 1 when one fails or runs over.

    python -m benchmarks.notebooks                      # all eight, once each
    python -m benchmarks.notebooks --repeats 3 02_rollouts 03_update
    python -m benchmarks.notebooks 02_rollouts -p DEVICE=cuda \
        -p 'OVERRIDES=["model.dtype=bfloat16", "engine.name=vllm"]'   # tiny-sft, vLLM on a GPU
    python -m benchmarks.notebooks 02_rollouts --random-shape qwen3-vl-8b-shape -p PRESET=seed_gpu
        # the 8B architecture with random weights, saved once under --out (BASE_MODEL)

`-p NAME=VALUE` sets a parameter (VALUE read as a Python literal, else as a string); with any
parameter given the 30 s budget (a CPU figure) is not applied. Each run's metrics.json is
printed in one line beside its time.

The pretrained tiny policy (tiny-sft) must be built already (`python -m workbench.rl.pretrained`),
or the first notebook pays for its build.

Answers: How long does each notebook take with its committed parameters? Figures:
benchmarks/RESULTS.md, "Notebooks on the H200".
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "workbench-bench"
BUDGET_S = 30.0


def install_kernel(prefix: Path) -> None:
    """A kernelspec named KERNEL for this interpreter, on a JUPYTER_PATH searched first."""
    from ipykernel.kernelspec import install

    install(kernel_name=KERNEL, display_name="Python (workbench bench)", prefix=str(prefix))
    os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")


def time_notebook(name: str, out: Path, parameters: dict[str, Any] | None = None) -> float:
    """Seconds to execute notebooks/<name>.ipynb into out/ with its defaults and `parameters`."""
    import papermill

    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    papermill.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(out / f"{name}.ipynb"),
                               parameters={**(parameters or {}), "OUT_DIR": str(out)},
                               kernel_name=KERNEL, cwd=str(out), progress_bar=False,
                               execution_timeout=1800)
    return time.perf_counter() - start


def parameter(text: str) -> tuple[str, Any]:
    """NAME=VALUE of `-p`: VALUE as a Python literal (1e-3, [..], None), else the string."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"-p takes NAME=VALUE, not {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def metrics_line(out: Path, width: int = 400) -> str:
    """The run's metrics.json in one line (cut at `width` characters), or why there is none."""
    path = out / "metrics.json"
    if not path.is_file():
        return "no metrics.json"
    text = json.dumps(json.loads(path.read_text()), separators=(",", ":"))
    return text if len(text) <= width else text[:width] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook names (default: all)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / "notebooks"))
    parser.add_argument("-p", dest="parameters", type=parameter, action="append", default=[],
                        metavar="NAME=VALUE", help="a notebook parameter (repeatable)")
    parser.add_argument("--random-shape", default="", metavar="SHAPE",
                        help="BASE_MODEL: this shape of model.presets.SHAPES with random bf16 "
                             "weights, saved once under --out")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # 06's local Ray: no token in ~/.ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    names = args.names or sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    parameters = dict(args.parameters)
    if args.random_shape:
        import torch

        from workbench.model.presets import save_random

        start = time.perf_counter()
        # absolute: each notebook's kernel runs in its own out folder
        folder = (Path(args.out) / f"random-{args.random_shape}").resolve()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        parameters["BASE_MODEL"] = save_random(args.random_shape, folder, device=device)
        print(f"BASE_MODEL {folder} (random weights) ready in {time.perf_counter() - start:.1f} s")
    budget = BUDGET_S if not parameters else float("inf")
    over = []
    with tempfile.TemporaryDirectory() as prefix:
        install_kernel(Path(prefix))
        print(f"{'notebook':<16} {'median s':>9}  runs (s)   [{os.cpu_count()} cores] "
              f"{json.dumps(parameters)}")
        for name in names:
            outs = [Path(args.out) / name / str(r) for r in range(args.repeats)]
            try:
                runs_s = [time_notebook(name, out, parameters) for out in outs]
            except Exception as err:  # papermill's execution error: report it, run the others
                print(f"{name:<16} FAILED  {str(err).strip().splitlines()[-1][:300]}", flush=True)
                over.append(name)
                continue
            median_s = statistics.median(runs_s)
            flag = "" if median_s <= budget else f"  over the {BUDGET_S:.0f} s budget"
            print(f"{name:<16} {median_s:>9.1f}  {', '.join(f'{s:.1f}' for s in runs_s)}{flag}",
                  flush=True)
            print(f"  metrics: {metrics_line(outs[-1])}", flush=True)
            if flag:
                over.append(name)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
