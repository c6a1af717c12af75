"""The named builders and ``for_plan``: each is its schedule kind's ``build``, with the plan's swaps and recomputes."""

from __future__ import annotations

from vpipe_lab.core import schedules
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules import builders
from vpipe_lab.core.schedules.actions import Op


def test_each_builder_is_its_kinds_build_and_for_plan_follows_the_plan() -> None:
    assert builders.gpipe(2, 4) == schedules.get("gpipe").build(2, 4)
    assert builders.one_f_one_b(3, 6, eager=True) == schedules.get("eager-1f1b").build(3, 6)
    assert builders.zb_h1(2, 4) == schedules.get("zb-h1").build(2, 4)
    assert builders.interleaved_1f1b(2, 3, 4) == schedules.get("interleaved-1f1b").build(2, 4, virtual=3)
    assert builders.zbv_schedule(2, 4) == schedules.get("zbv").build(2, 4)
    plan = Plan((0, 2, 4), ("keep", "recompute", "swap", "keep"), 2, "1f1b")
    built = builders.for_plan(plan)
    assert built.name == "1f1b" and any(a.op is Op.RECOMPUTE and a.layer == 1 for a in built.stages[0])
    assert any(a.op is Op.SWAP_OUT and a.layer == 2 for a in built.stages[1])
