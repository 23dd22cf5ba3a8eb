"""Per-step training metrics as Ray metrics (`ray.util.metrics` gauges), so Ray's dashboard, and
Prometheus / Grafana where a user has them, show reward, success and phase times next to the
cluster's CPU, GPU and memory.

The gauges live in trainer worker 0 (a Ray actor), not in the driver: a driver connected through
Ray Client has no metrics agent of its own. Each metrics row key becomes one gauge, `/` -> `_`
and prefixed `workbench_` (Prometheus adds Ray's `ray_` prefix), tagged with the run's name:

    ray_workbench_reward_mean{run="grpo-demo", ...} 0.42
    ray_workbench_time_rollout{run="grpo-demo", ...} 5.6
"""

from __future__ import annotations

import re
from typing import Any

PREFIX = "workbench_"
TAG_KEYS = ("run",)


def gauge_name(key: str) -> str:
    """Metrics-row key -> Ray metric name ("reward/mean" -> "workbench_reward_mean")."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def numeric_items(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers (not its step or any text), by gauge name."""
    return {gauge_name(k): float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class GaugeSet:
    """One Ray gauge per metric name, created on first use (lives in a Ray worker process)."""

    def __init__(self) -> None:
        self.gauges: dict[str, Any] = {}

    def record(self, row: dict[str, Any], run: str) -> int:
        """Set a gauge for each number of the row; returns how many were set."""
        from ray.util.metrics import Gauge

        values = numeric_items(row)
        for name, value in values.items():
            if name not in self.gauges:
                self.gauges[name] = Gauge(name, f"workbench training metric {name}", TAG_KEYS)
            self.gauges[name].set(value, tags={"run": run})
        return len(values)
