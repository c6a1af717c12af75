"""Re-planning onto the stages that remain (core/planning/fewer.py)."""

from __future__ import annotations

import pytest

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.fewer import fewer_stages, onto, spread


def test_the_layers_and_policies_go_onto_one_stage_fewer_balanced_by_cost() -> None:
    plan = Plan((0, 2, 4, 6), ("keep", "swap", "keep", "recompute", "keep", "keep"), 4)
    times = [1.0, 1.0, 1.0, 1.0, 4.0, 4.0]
    got = fewer_stages(plan, 1, times)
    assert got.plan.stages == 2 and got.plan.policies == plan.policies and got.plan.microbatches == 4
    assert got.plan.boundaries == (0, 5, 6)  # 4 + 4 against 4 + 4 + ... the costly last layers split
    assert "balanced by the measured layer times" in got.how and got.plan.schedule == "1f1b"


def test_without_times_the_split_is_even() -> None:
    plan = Plan.from_counts([3, 3, 2], 4)
    got = fewer_stages(plan, 2)
    assert got.plan.boundaries == (0, 4, 8) and "equal layer counts" in got.how


def test_interleaved_keeps_its_chunks_per_stage() -> None:
    plan = Plan(tuple(range(0, 7)), ("keep",) * 6, 4, "interleaved-1f1b", 2)  # 3 stages x 2 chunks
    got = fewer_stages(plan, 0)
    assert got.plan.stages == 2 and got.plan.chunks == 4 and got.plan.schedule == "interleaved-1f1b"
    assert got.how.startswith("interleaved-1f1b on 2 stages")


def test_a_schedule_that_cannot_run_on_fewer_falls_back_to_1f1b_and_says_why() -> None:
    plan = Plan(tuple(range(0, 13)), ("keep",) * 12, 6, "interleaved-1f1b", 2)  # 6 stages x 2 chunks, 6 micro-batches
    got = fewer_stages(plan, 0)
    assert got.plan.stages == 5 and got.plan.schedule == "1f1b" and got.plan.virtual_stages == 1
    assert "interleaved-1f1b cannot run on 5" in got.how and "multiple of 5" in got.how


def test_spread_shares_a_stage_time_by_its_layers() -> None:
    assert spread(Plan.from_counts([1, 3], 2), [2.0, 3.0]) == [2.0, 1.0, 1.0, 1.0]
    with pytest.raises(PlanError, match="3 stage times for a plan of 2 stages"):
        spread(Plan.from_counts([1, 3], 2), [1.0, 1.0, 1.0])


@pytest.mark.parametrize(("plan", "lost", "match"), [
    (Plan.from_counts([2], 2), 0, "one stage has no stage to fall back on"),
    (Plan.from_counts([2, 2], 2), 2, "stage 2 is not one of the plan's 2 stages"),
])
def test_refusals_name_the_problem(plan: Plan, lost: int, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        fewer_stages(plan, lost)


def test_layer_times_must_match_the_layers() -> None:
    with pytest.raises(PlanError, match="2 layer times for a plan of 4 layers"):
        fewer_stages(Plan.from_counts([2, 2], 2), 0, [1.0, 1.0])


def test_onto_more_stages_when_a_node_comes_back() -> None:
    got = onto(Plan.from_counts([10], 4), 2, [1.0] * 8 + [4.0, 4.0])
    assert got.plan.boundaries == (0, 8, 10) and got.how == "1f1b on 2 stages, balanced by the measured layer times"
    with pytest.raises(PlanError, match="stages must be a whole number >= 1, got 0"):
        onto(Plan.from_counts([10], 4), 0)
    with pytest.raises(PlanError, match="cannot split 10 layers into 11 stages"):
        onto(Plan.from_counts([10], 4), 11)
