"""Wall time of every notebook with its committed parameters (only OUT_DIR passed), as CI runs
them: papermill on a kernel of this interpreter, kernel start included. Prints one line per
notebook and the median of `--repeats` runs, flagging any over its 30 s budget on 2 cores.

    python -m benchmarks.notebooks                      # all eight, once each
    python -m benchmarks.notebooks --repeats 3 02_rollouts 03_update

The pretrained tiny policy (tiny-sft) must be built already (`python -m workbench.rl.pretrained`),
or the first notebook pays for its build.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
KERNEL = "workbench-bench"
BUDGET_S = 30.0


def install_kernel(prefix: Path) -> None:
    """A kernelspec named KERNEL for this interpreter, on a JUPYTER_PATH searched first."""
    from ipykernel.kernelspec import install

    install(kernel_name=KERNEL, display_name="Python (workbench bench)", prefix=str(prefix))
    os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")


def time_notebook(name: str, out: Path) -> float:
    """Seconds to execute notebooks/<name>.ipynb into out/ with its defaults."""
    import papermill

    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    papermill.execute_notebook(str(NOTEBOOKS / f"{name}.ipynb"), str(out / f"{name}.ipynb"),
                               parameters={"OUT_DIR": str(out)}, kernel_name=KERNEL,
                               cwd=str(out), progress_bar=False, execution_timeout=600)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook names (default: all)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench" / "notebooks"))
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # 06's local Ray: no token in ~/.ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    names = args.names or sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    over = []
    with tempfile.TemporaryDirectory() as prefix:
        install_kernel(Path(prefix))
        print(f"{'notebook':<16} {'median s':>9}  runs (s)   [{os.cpu_count()} cores]")
        for name in names:
            runs_s = [time_notebook(name, Path(args.out) / name / str(r))
                      for r in range(args.repeats)]
            median_s = statistics.median(runs_s)
            flag = "" if median_s <= BUDGET_S else f"  over the {BUDGET_S:.0f} s budget"
            print(f"{name:<16} {median_s:>9.1f}  {', '.join(f'{s:.1f}' for s in runs_s)}{flag}",
                  flush=True)
            if flag:
                over.append(name)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
