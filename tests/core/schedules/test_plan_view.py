"""The schedules read a plan through ``PlanView``: a real Plan is one, and what they read of it shapes their order."""

from __future__ import annotations

from collections.abc import Sequence

from vpipe_lab.core import schedules
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.policy import Policy
from vpipe_lab.core.schedules.actions import Op
from vpipe_lab.core.schedules.plan_view import PlanView


class Bare:
    """Only what the protocol names: a plan from some other tool, say."""

    policies = (Policy.KEEP, Policy.SWAP, Policy.KEEP, Policy.KEEP)
    virtual_stages = 1

    def chunk_layers(self, chunk: int) -> range:
        return range(2 * chunk, 2 * chunk + 2)

    def layers_of(self, stage: int) -> Sequence[int]:
        return self.chunk_layers(stage)


def test_a_plan_and_anything_shaped_like_one_build_the_same_schedule() -> None:
    view: PlanView = Bare()
    real = Plan((0, 2, 4), tuple(Bare.policies), 2, "1f1b")
    kind = schedules.get("1f1b")
    assert kind.build(2, 2, view) == kind.build(2, 2, real)
    assert any(a.op is Op.SWAP_OUT and a.layer == 1 for a in kind.build(2, 2, view).stages[0])
