"""ZB-H1's kind: a split backward, W steps held back, and its order refined by the plan's recomputes."""

from vpipe_lab.core import schedules
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules.actions import Op


def test_zb_h1() -> None:
    kind = schedules.get("zb-h1")
    assert kind.split_backward and not kind.chunked
    rows = kind.orders(2, 1, 4)
    assert all(sum(op is Op.W for op, _, _ in row) == 4 for row in rows)
    assert kind.waiting_w(4, 0, 8) == 5 and kind.waiting_w(4, 0, 2) == 2
    recomputing = Plan((0, 2, 4), ("recompute",) * 2 + ("keep",) * 2, 4, "zb-h1")
    assert kind.orders(2, 1, 4, recomputing) != rows  # stage 0's B costs a forward more: W steps placed otherwise
    assert kind.build(2, 4).name == "zb-h1"
