"""Sharded stages planned: each stage's sharding, and N devices split into stages x shards x replicas."""

from __future__ import annotations

import itertools

import pytest

from vpipe_lab.core import workloads
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.cost.scaling import at
from vpipe_lab.core.errors import InfeasiblePlan, PlanError
from vpipe_lab.core.planning.mesh import choose, search_sharded, shapes
from vpipe_lab.core.planning.planner import search
from vpipe_lab.core.report import mesh_words
from vpipe_lab.core.sharding import Sharding

GIB = 1 << 30
PROFILE = workloads.workload("gpt-cpm-large", device="h200")  # 66 units, 34 GiB of static bytes with Adam


def cluster(stages: int, memory: int = 24 * GIB):  # type: ignore[no-untyped-def]
    return workloads.cluster("h200", stages, memory_bytes=memory)


def test_the_meshes_of_n_devices_are_every_factorisation_the_batch_splits_over() -> None:
    assert shapes(8, 66, 64) == [(s, k, 8 // s // k) for s in (1, 2, 4, 8) for k in range(1, 8 // s + 1)
                                 if (8 // s) % k == 0]
    # a batch of 4 splits over 1 or 2 data-parallel ranks, not 3 or 6: 1 or 2 stages are out
    assert shapes(6, 66, 4) == [(3, 1, 2), (3, 2, 1), (6, 1, 1)]
    assert shapes(8, 3, 64)[-1][0] == 2  # never more stages than units
    with pytest.raises(PlanError, match="devices"):
        shapes(0, 66, 64)


def test_each_stages_sharding_is_at_least_as_fast_as_every_one_for_all_stages() -> None:
    """The refinement starts from the fastest sharding on all stages and only takes faster plans that fit."""
    found = search_sharded(PROFILE, cluster(2), shards=4, batch_size=16)
    assert found.plan.shards == 4 and len(found.plan.sharding) == 2
    for mode in Sharding:
        try:
            uniform = search(PROFILE, cluster(2), batch_size=16, mesh=(4, 1, (mode, mode)))
        except InfeasiblePlan:
            continue
        assert found.estimate.iteration_s <= uniform.estimate.iteration_s + 1e-12
    assert found.estimate.feasible and not found.proven_optimal
    # and what the search picked is the best of every per-stage assignment on its partition and policies
    scaled = at(PROFILE, found.microbatch_size) if found.microbatch_size else PROFILE
    best = min(estimate(found.plan.with_mesh(sharding=combo), scaled, cluster(2)).iteration_s
               for combo in itertools.product(Sharding, repeat=2)
               if estimate(found.plan.with_mesh(sharding=combo), scaled, cluster(2)).feasible)
    assert found.estimate.iteration_s == pytest.approx(best, rel=1e-9) or found.estimate.iteration_s <= best


def test_under_a_budget_whole_stages_cannot_meet_a_sharded_mesh_fits() -> None:
    """6 GiB a device: no pipeline of 8 whole stages fits (stage 0 alone holds more, swap and recompute as it
    may), 8 shards of one stage do; at 4 GiB nothing does (34 GiB of static bytes are over 4 GiB a device)."""
    with pytest.raises(InfeasiblePlan):
        search(PROFILE, cluster(8, 6 * GIB), batch_size=64)
    chosen = choose(PROFILE, lambda s: cluster(s, 6 * GIB), devices=8, batch_size=64)
    assert chosen.result.estimate.feasible and chosen.result.plan.shards > 1 and chosen.pipeline_only is None
    assert all(p <= 6 * GIB for p in chosen.result.estimate.peak_bytes)
    # what a notebook shows of it: the choice in one line, not every plan tried
    shown = repr(chosen)
    assert shown.startswith(f"MeshResult({mesh_words(*chosen.shape)}: ") and shown.endswith("whole devices: none fits)")
    assert "\n" not in shown and len(shown) < 200
    with pytest.raises(InfeasiblePlan, match="no mesh of 8 devices fits a batch of 64"):
        choose(PROFILE, lambda s: cluster(s, 4 * GIB), devices=8, batch_size=64)


@pytest.mark.parametrize("devices", [8, 64])
def test_the_chosen_mesh_is_never_slower_than_the_best_pipeline_of_whole_devices(devices: int) -> None:
    chosen = choose(PROFILE, cluster, devices=devices, batch_size=64)
    plan = chosen.result.plan
    assert plan.devices == devices and chosen.shape == (plan.stages, plan.shards, plan.replicas)
    times = [t for _, t in chosen.tried if t is not None]
    assert chosen.result.estimate.iteration_s == min(times)
    if chosen.pipeline_only is not None:
        assert chosen.result.estimate.iteration_s <= chosen.pipeline_only.estimate.iteration_s


def test_a_mesh_the_batch_cannot_split_over_is_refused() -> None:
    with pytest.raises(PlanError, match="splits a batch of 3 evenly"):
        choose(PROFILE, cluster, devices=2, batch_size=3, shapes_to_try=[])
