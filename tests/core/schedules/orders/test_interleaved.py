"""Interleaved 1F1B: Megatron-LM's order over looped chunks, its bubble, its memory, and plans with virtual stages."""

from __future__ import annotations

import math

import pytest

from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.errors import PlanError, ProfileError, ScheduleError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.layer_moves import layer_moves
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile
from vpipe_lab.core.schedules.actions import Op, run_schedule
from vpipe_lab.core.schedules.builders import interleaved_1f1b
from vpipe_lab.core.schedules.orders import interleaved


@pytest.mark.parametrize(("k", "v", "m"), [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 3, 8), (3, 2, 6), (2, 1, 4)])
def test_equal_chunks_take_m_plus_k_minus_1_over_v_stage_times(k: int, v: int, m: int) -> None:
    """F = 1/V, B = 2/V per chunk: the iteration is (M + (K-1)/V) * 3, against 1F1B's (M + K - 1) * 3."""
    schedule = interleaved_1f1b(k, v, m).validate()
    t = run_schedule(schedule, lambda a: {Op.F: 1.0 / v, Op.B: 2.0 / v}.get(a.op, 0.0))
    assert math.isclose(t.iteration_s, (m + (k - 1) / v) * 3)
    assert {s.stage for s in t} == set(range(k))  # drawn on the stages (devices), each running its chunks
    for r, order in enumerate(interleaved.orders(k, v, m)):
        assert sorted(order) == sorted((op, c, mb) for op in "FB" for c in range(r, k * v, k) for mb in range(m))


def test_megatrons_order_literal() -> None:
    rows = [" ".join(row) for row in interleaved_1f1b(2, 2, 4).compute_only().to_strings()]
    assert rows == ["0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
                    "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"]
    assert interleaved.peak_inflight(2, 2, 4, 0) == 5 and interleaved.peak_inflight(2, 2, 4, 1) == 3


def test_micro_batches_come_in_groups_of_the_stages() -> None:
    with pytest.raises(ScheduleError, match="6 micro-batches is not a multiple of 4; use 8"):
        interleaved.orders(4, 2, 6)
    with pytest.raises(PlanError, match="microbatches=6 must be a multiple of 4"):
        Plan(tuple(range(9)), ("keep",) * 8, 6, "interleaved-1f1b", 2).validate()  # 8 chunks: 4 stages


def test_a_plan_with_virtual_stages() -> None:
    plan = Plan((0, 2, 3, 5, 8), ("keep",) * 8, 4, "interleaved-1f1b", 2).validate(8, 2)
    assert plan.stages == 2 and plan.chunks == 4 and plan.chunks_of(1) == (1, 3)
    assert list(plan.layers_of(0)) == [0, 1, 3, 4] and list(plan.layers_of(1)) == [2, 5, 6, 7]
    assert [plan.stage_of(i) for i in range(8)] == [0, 0, 1, 0, 0, 1, 1, 1]
    assert Plan.from_json(plan.to_json()) == plan and "V=2" in plan.describe() and "[2:3]K@1" in plan.describe()
    with pytest.raises(PlanError, match=r"chunked schedule, not '1f1b' \(the chunked ones: interleaved-1f1b, zbv, dual"):
        Plan((0, 2, 3, 5, 8), ("keep",) * 8, 4, "1f1b", 2).validate()
    with pytest.raises(PlanError, match="3 virtual stages per stage do not divide"):
        Plan((0, 2, 3, 5, 8), ("keep",) * 8, 4, "interleaved-1f1b", 3).validate()
    with pytest.raises(ProfileError, match="virtual_stages must be a whole number"):
        Plan.from_dict({**plan.to_dict(), "virtual_stages": 0})
    # 1F1B's plan to the interleaved one: layer 3 and 4 go to stage 0, layer 2 stays on stage 1
    assert [(m.layer, m.src, m.dst) for m in layer_moves((0, 4, 8), plan.boundaries, 2)] == [(2, 0, 1), (4, 1, 0)]


def test_cost_model_and_simulator_agree_on_equal_chunks() -> None:
    profile = ModelProfile(tuple(LayerCost(f"l{i}", 1.0, 2.0, 100, 10, 10, 10) for i in range(8)))
    cluster = Cluster(2, 10**9, 1e9, 1e30)
    plan = Plan((0, 2, 4, 6, 8), ("keep",) * 8, 4, "interleaved-1f1b", 2)
    est = estimate(plan, profile, cluster)
    assert est.iteration_s == simulate(plan, profile, cluster).iteration_s == (4 + 1 / 2) * 12
    assert est.iteration_s < estimate(Plan((0, 4, 8), ("keep",) * 8, 4), profile, cluster).iteration_s
    # stage 0 holds 5 chunk-forwards at its peak (2 layers x 100 bytes each), stage 1 three; 4 layers' statics each
    assert est.inflight == (5, 3) and est.activation_bytes == (1000, 600) and est.static_bytes == (80, 80)
