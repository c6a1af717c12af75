"""What a schedule kind derives from its order alone, checked against the built-in schedules' closed forms."""

from __future__ import annotations

import pytest

from vpipe_lab.core import schedules
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.schedules import ScheduleKind
from vpipe_lab.core.schedules.actions import Op

SHAPES = [(k, m) for k in (2, 3, 4) for m in (1, 2, 4, 8)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b", "zb-h1", "pipedream"])
def test_the_in_flight_count_from_the_order_is_each_schedules_closed_form(name: str) -> None:
    kind = schedules.get(name)
    for k, m in SHAPES:
        assert [kind.inflight(k, s, m, 1) for s in range(k)] == [ScheduleKind.inflight(kind, k, s, m, 1)
                                                                  for s in range(k)], (k, m)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b", "pipedream"])
def test_the_replayed_order_is_each_closed_form_iteration(name: str) -> None:
    """Unequal stages, no latency: the default (its order replayed) and the closed form agree exactly."""
    kind = schedules.get(name)
    for k, m in SHAPES:
        forward, backward = [1.0 + 0.1 * s for s in range(k)], [2.0 - 0.1 * s for s in range(k)]
        inflight = [kind.inflight(k, s, m, 1) for s in range(k)]
        assert kind.iteration_time(forward, backward, m, (), 0.0, inflight) == pytest.approx(
            ScheduleKind.iteration_time(kind, forward, backward, m, (), 0.0, inflight)), (k, m)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zbv"])
def test_the_held_states_from_the_order_are_the_chunked_schedules_own(name: str) -> None:
    kind = schedules.get(name)
    for k in (2, 3, 4):
        for m in (k, 2 * k):
            v = kind.default_virtual
            for rank in range(k):
                assert kind.held(k, v, m, rank) == ScheduleKind.held(kind, k, v, m, rank)


def test_a_schedule_without_an_order_says_so_and_checks_name_what_goes_together() -> None:
    class Orderless(ScheduleKind):
        name = "orderless"

    with pytest.raises(NotImplementedError, match="does not say its order"):
        Orderless().build(2, 4)
    assert schedules.get("1f1b").check_virtual(2) == "virtual_stages=2 needs a chunked schedule, not '1f1b'"
    assert schedules.virtual_refusal("1f1b", 2) == ("virtual_stages=2 needs a chunked schedule, not '1f1b' (the "
                                                    "chunked ones: interleaved-1f1b, zbv, dualpipev)")
    assert schedules.get("zbv").check_virtual(3) == "zbv runs 2 chunks per stage, not virtual_stages=3"
    assert schedules.get("interleaved-1f1b").check_virtual(3) is None
    with pytest.raises(PlanError, match="unknown schedule 'nope'"):
        schedules.get("nope")


def test_build_expands_the_order_with_transfers_in_the_kinds_placement() -> None:
    built = schedules.get("zbv").build(2, 2)
    assert built.placement == (0, 1, 1, 0) and built.name == "zbv"
    turn = [a for a in built.stages[1] if (a.op is Op.SEND_F and a.stage == 1) or (a.op is Op.RECV_F and a.stage == 2)]
    assert turn == []  # the V's turn (chunks 1 and 2, both on stage 1) hands over without a transfer
    assert any(a.op is Op.SEND_F and a.stage == 0 for a in built.stages[0])  # stage 0 to stage 1 does transfer
    assert schedules.get("gpipe").build(2, 2).placement == (0, 1)
