"""ZB-H1's order: every step once, 1F1B's activation memory, and the paper's bubble with unit costs."""

from __future__ import annotations

import pytest

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules.actions import Op, run_schedule
from vpipe_lab.core.schedules.builders import one_f_one_b, zb_h1
from vpipe_lab.core.schedules.orders import zero_bubble

UNIT = {Op.F: 1.0, Op.B: 1.0, Op.W: 1.0}


def unit(a) -> float:  # type: ignore[no-untyped-def]
    return UNIT.get(a.op, 0.0)


@pytest.mark.parametrize(("k", "m"), [(1, 3), (2, 1), (2, 8), (3, 5), (4, 8), (8, 8), (8, 32)])
def test_every_stage_runs_each_step_once_within_its_memory(k: int, m: int) -> None:
    for s, order in enumerate(zero_bubble.zb_h1_orders(k, m)):
        assert sorted(order) == sorted((op, mb) for op in "FBW" for mb in range(m))
        done = {"F": 0, "B": 0, "W": 0}
        for op, mb in order:
            assert mb == done[op]  # each kind in micro-batch order
            done[op] += 1
            # 1F1B's count between F and B; max(K, K - s + 1) between F and W
            assert done["F"] - done["B"] <= min(m, k - s)
            assert done["F"] - done["W"] <= zero_bubble.waiting_w(k, s)
    zb_h1(k, m).validate()


@pytest.mark.parametrize(("k", "m"), [(2, 4), (2, 8), (4, 8), (4, 16), (8, 8)])
def test_unit_costs_give_the_papers_bubble(k: int, m: int) -> None:
    """F = B = W = 1: ZB-H1's iteration is 3M + (K - 1) (the paper's (K-1)(F+B-W) bubble), 1F1B's (M+K-1) * 3."""
    assert run_schedule(zb_h1(k, m), unit).iteration_s == 3 * m + (k - 1)
    whole = run_schedule(one_f_one_b(k, m), lambda a: {Op.F: 1.0, Op.B: 2.0}.get(a.op, 0.0)).iteration_s
    assert whole == 3 * (m + k - 1)


def test_weight_steps_fill_the_drain_and_follow_their_backward() -> None:
    rows = [" ".join(row) for row in zb_h1(2, 4).compute_only().to_strings()]
    assert rows == ["0F0 0F1 0B0 0F2 0B1 0W0 0F3 0B2 0W1 0W2 0B3 0W3",
                    "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1F3 1B3 1W2 1W3"]


def test_a_recomputing_stage_gets_a_longer_backward_in_the_order() -> None:
    """The plan's recomputed layers lengthen that stage's B in the list scheduling; the order stays valid."""
    plan = Plan((0, 2, 4), ("recompute",) * 2 + ("keep",) * 2, 6, "zb-h1")
    schedule = zb_h1(2, 6, plan).validate()
    assert [a for a in schedule.stages[0] if a.op is Op.RECOMPUTE]  # the rebuilds before each backward
    assert schedule.compute_only().stages != zb_h1(2, 6).compute_only().stages
