"""Swap and recompute lower a stage's measured resident activations by what the cost model predicts (within 10%)."""

from __future__ import annotations

import pytest

import vpipe_lab
from vpipe_lab import Cluster, Plan
from vpipe_lab.core.costmodel import CostModel
from vpipe_lab.core.plan import SCHEDULES

pytestmark = pytest.mark.slow

BOUNDS = (0, 4, 10)


def measure(policies: str, schedule: str) -> tuple[dict[int, int], vpipe_lab.ModelProfile]:
    plan = Plan(BOUNDS, tuple(policies), 4, schedule)
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, schedule=schedule, plan=plan, device="cpu",
                          timeout=60) as s:
        s.run(3)
        s.wait(timeout=120)
        mem = s.metrics.memory
        last = mem[mem["iteration"] == mem["iteration"].max()]
        resident = {int(r.stage): int(r.resident) for r in last.itertuples()}
        profile = s.profile()
    return resident, profile


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_measured_savings_match_the_cost_model(schedule: str) -> None:
    keep = "k" * 10
    mixed = "srkr" + "rsskrk"  # swap and recompute on both stages
    measured_keep, profile = measure(keep, schedule)
    measured_mixed, _ = measure(mixed, schedule)
    cm = CostModel(profile, Cluster(2, 10**12, 1e9, 1e9), 4, schedule)
    for stage in (0, 1):
        lo, hi = BOUNDS[stage], BOUNDS[stage + 1]
        predicted = [cm.stage_cost(stage, lo, hi, Plan(BOUNDS, tuple(p), 4, schedule).policies) for p in (keep, mixed)]
        predicted_saving = (predicted[0].activation_bytes + predicted[0].swap_buffer_bytes) - (
            predicted[1].activation_bytes + predicted[1].swap_buffer_bytes)
        measured_saving = measured_keep[stage] - measured_mixed[stage]
        assert predicted_saving > 0
        assert measured_saving == pytest.approx(predicted_saving, rel=0.10), (stage, measured_keep, measured_mixed)


def test_eager_1f1b_holds_one_more_micro_batch_where_the_cost_model_says() -> None:
    keep = "k" * 10
    plain, profile = measure(keep, "1f1b")
    eager, _ = measure(keep, "eager-1f1b")
    cluster = Cluster(2, 10**12, 1e9, 1e9)
    for stage in (0, 1):
        lo, hi = BOUNDS[stage], BOUNDS[stage + 1]
        policies = Plan(BOUNDS, tuple(keep), 4, "1f1b").policies
        predicted = [CostModel(profile, cluster, 4, schedule).stage_cost(stage, lo, hi, policies).activation_bytes
                     for schedule in ("1f1b", "eager-1f1b")]
        assert eager[stage] / plain[stage] == pytest.approx(predicted[1] / predicted[0], rel=0.10), (stage, plain,
                                                                                                     eager)
    assert eager[0] > 1.4 * plain[0] and eager[1] == pytest.approx(plain[1], rel=0.05)  # 3 vs 2; the last stage 1
