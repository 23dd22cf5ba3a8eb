"""How a notebook hands its key numbers to its tests: the last cell records them as JSON (the
path comes from the notebook's OUT_DIR parameter), and tests/test_notebooks.py reads them back
and asserts them.

    record_metrics({"steps": [1, 2, 3]}, f"{OUT_DIR}/metrics.json")   # a notebook's last cell
    read_recorded(out / "metrics.json")                                # the test
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def jsonable(value: Any) -> Any:
    """Plain JSON values: numpy scalars and arrays, tuples and dataclass-free containers."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def record_metrics(values: dict[str, Any], path: str | Path) -> None:
    """Write a notebook's key metrics as JSON (tests read it with read_recorded); prints where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = jsonable(values)
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    print(f"recorded {len(data)} metrics to {path}")


def read_recorded(path: str | Path) -> dict[str, Any]:
    """The metrics a notebook recorded."""
    return json.loads(Path(path).read_text())
