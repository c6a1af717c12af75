"""A row's compute order expanded: receives before forwards, sends after, swaps prefetched, recomputes before B."""

from __future__ import annotations

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules.actions import Op
from vpipe_lab.core.schedules.expand import expand


def test_the_middle_stage_receives_sends_swaps_and_recomputes() -> None:
    plan = Plan((0, 1, 3, 4), ("keep", "swap", "recompute", "keep"), 2, "gpipe")
    order = [(Op.F, 1, 0), (Op.F, 1, 1), (Op.B, 1, 1), (Op.B, 1, 0)]
    row = [str(a) for a in expand(order, 3, plan)]
    # after F1, the swap-in of the backward after next (B0) is issued, to overlap B1; B1's own comes right before it
    assert row == ["1RF0", "1F0", "1SO0.1", "1SF0", "1RF1", "1F1", "1SO1.1", "1SF1", "1SI0.1",
                   "1RB1", "1RC1.2", "1SI1.1", "1B1", "1SB1", "1RB0", "1RC0.2", "1B0", "1SB0"]


def test_a_shared_row_hands_over_locally() -> None:
    order = [(Op.F, 0, 0), (Op.F, 1, 0), (Op.B, 1, 0), (Op.B, 0, 0)]
    row = [str(a) for a in expand(order, 2, None, (0, 0))]
    assert row == ["0F0", "1F0", "1B0", "0B0"]  # no transfer between two chunks of one row
