"""Where the trainer workers and sampler engines go: placement-group bundles.

colocate_all=True: bundle i holds trainer worker i and sampler engine i, each with a fraction
of the bundle (half its GPU on a GPU cluster, `cpus_per_actor` CPUs each), so a policy shard and
its sampler share one GPU. colocate_all=False: every actor gets a bundle of its own (a whole GPU
on a GPU cluster); trainers take bundles 0..N-1, engines N..N+M-1. One placement group, PACK.

    plan = plan_placement(num_workers=2, num_engines=2, colocate_all=True, use_gpu=False)
    plan.bundles        # [{"CPU": 1.0}, {"CPU": 1.0}]
    plan.trainer_bundle_N, plan.engine_bundle_M   # [0, 1], [0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.deps import require

COLOCATED_GPU_SHARE = 0.5  # a trainer and an engine in one bundle each take half its GPU


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles of one placement group and which bundle each actor takes."""

    bundles: list[dict[str, float]]
    trainer_bundle_N: list[int]
    engine_bundle_M: list[int]
    trainer_resources: dict[str, float]  # Ray actor options: num_cpus, num_gpus
    engine_resources: dict[str, float]


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}


def plan_placement(num_workers: int, num_engines: int, colocate_all: bool, use_gpu: bool,
                   cpus_per_actor: float = 0.5) -> PlacementPlan:
    """The bundles for N trainer workers and M sampler engines."""
    N, M, c = num_workers, num_engines, cpus_per_actor
    if colocate_all:
        gpu_share = COLOCATED_GPU_SHARE if use_gpu else 0.0
        bundles = [_bundle(c * ((i < N) + (i < M)), 1.0 if use_gpu else 0.0)
                   for i in range(max(N, M))]
        return PlacementPlan(bundles, list(range(N)), list(range(M)),
                             {"num_cpus": c, "num_gpus": gpu_share},
                             {"num_cpus": c, "num_gpus": gpu_share})
    gpus = 1.0 if use_gpu else 0.0
    return PlacementPlan([_bundle(c, gpus) for _ in range(N + M)], list(range(N)),
                         list(range(N, N + M)), {"num_cpus": c, "num_gpus": gpus},
                         {"num_cpus": c, "num_gpus": gpus})


def create_placement_group(plan: PlacementPlan, timeout_s: float = 120.0) -> Any:
    """Reserve the plan's bundles (PACK); a clear error when the cluster cannot fit them."""
    ray = require("ray")
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(plan.bundles, strategy="PACK")
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        raise RuntimeError(f"the Ray cluster cannot fit bundles {plan.bundles} within "
                           f"{timeout_s:.0f} s (it has {ray.cluster_resources()}); lower "
                           "cluster.num_workers / cluster.num_engines or cluster.cpus_per_actor")
    return pg


def actor_options(plan: PlacementPlan, pg: Any, kind: str, index: int) -> dict[str, Any]:
    """Ray .options(...) for trainer/engine `index`: its resources and its bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = (plan.trainer_bundle_N if kind == "trainer" else plan.engine_bundle_M)[index]
    resources = plan.trainer_resources if kind == "trainer" else plan.engine_resources
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
    return dict(resources) | {"scheduling_strategy": strategy}


def actor_bundles(placement_group: Any) -> dict[str, int]:
    """Bundle index of each live actor of a placement group, by actor name, as Ray's state API
    reports it (needs the dashboard: connect(..., dashboard=True))."""
    from ray.util.state import list_actors

    pg_id = placement_group.id.hex()
    actors = list_actors(filters=[("placement_group_id", "=", pg_id), ("state", "=", "ALIVE")],
                         detail=True)
    out: dict[str, int] = {}
    for actor in actors:
        if actor.name is None or actor.required_resources is None:
            continue  # Ray's state API types both as optional; an unnamed actor has no key
        for key in actor.required_resources:  # e.g. CPU_group_1_<pg id>: bundle 1
            parts = key.split("_")
            if len(parts) == 4 and parts[1] == "group" and parts[2].isdigit():
                out[actor.name] = int(parts[2])
    return out
