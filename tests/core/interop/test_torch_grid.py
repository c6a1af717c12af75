"""The schedule grid (core/interop/torch_grid.py): every action after what it needs, bubbles as holes, and the text
torch's own ``_format_pipeline_order`` prints for the same grid."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _Action, _format_pipeline_order

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.interop.torch_grid import align, busy, format_grid, grid, grid_csv
from vpipe_lab.core.interop.torch_schedules import rows
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.partition import uniform

PLANS = [
    Plan(uniform(8, 2), ("keep",) * 8, 4, "1f1b"),
    Plan(uniform(8, 4), ("keep",) * 8, 8, "gpipe"),
    Plan(uniform(8, 4), ("keep",) * 8, 4, "interleaved-1f1b", 2),
    Plan(uniform(8, 4), ("keep",) * 8, 4, "zbv", 2),
    Plan(uniform(8, 3), ("keep",) * 8, 6, "zb-h1"),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.schedule)
def test_the_grid_keeps_each_rank_order_and_runs_nothing_before_what_it_needs(plan: Plan) -> None:
    steps = grid(plan)
    assert [[c for c in col if c] for col in zip(*steps)] == rows(plan)  # the lab's order, holes aside
    ran = {c: t for t, row in enumerate(steps) for c in row if c}
    for action, t in ran.items():
        stage, op, mb = int(action[:-2]), action[-2], int(action[-1])
        if op == "F" and stage > 0:
            assert ran[f"{stage - 1}F{mb}"] < t
        if op in "BI" and stage < plan.chunks - 1:
            assert min(ran.get(f"{stage + 1}I{mb}", 10**9), ran.get(f"{stage + 1}B{mb}", 10**9)) < t
        if op == "W":
            assert ran[f"{stage}I{mb}"] < t
    assert 0 < busy(steps) <= 1


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.schedule)
def test_the_text_is_what_torch_prints(plan: Plan) -> None:
    steps = grid(plan)
    order = {r: [_Action.from_str(row[r]) if row[r] else None for row in steps] for r in range(len(steps[0]))}
    assert format_grid(steps) == _format_pipeline_order(order)


def test_gpipe_on_four_stages_has_its_fill_and_drain_bubbles() -> None:
    steps = grid(PLANS[1])
    assert steps[0] == ["0F0", "", "", ""] and steps[3][3] == "3F0"
    assert len(steps) == 2 * (8 + 4 - 1)  # forwards then backwards, each fill + micro-batches - 1 deep
    text = grid_csv(steps).splitlines()
    assert text[0] == "step,rank 0,rank 1,rank 2,rank 3" and text[1] == "0,0F0,,,"


def test_an_order_that_cannot_finish_is_refused() -> None:
    with pytest.raises(PlanError, match="every rank waits"):
        align([["0B0"], ["1F0"]], 2)  # stage 0's backward before any forward
    with pytest.raises(PlanError, match="cannot read the action 'x'"):
        align([["x"]], 1)
