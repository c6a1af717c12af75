import pytest

from vpipe_lab.core.errors import ScheduleError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules.actions import Action, Op, Schedule
from vpipe_lab.core.schedules.builders import for_plan, gpipe, one_f_one_b


def test_action_string_round_trip() -> None:
    for text in ["1F0", "0B12", "2SF3", "0SO2.3", "4RC1.17", "3RB0", "1SI0.0"]:
        assert str(Action.parse(text)) == text
    assert Action.parse("0SO2.3") == Action(0, Op.SWAP_OUT, 2, 3)
    with pytest.raises(ScheduleError, match="cannot read action 'XF0'"):
        Action.parse("XF0")


def test_gpipe_order_literal() -> None:
    rows = gpipe(3, 2).to_strings()
    assert rows == [
        ["0F0", "0SF0", "0F1", "0SF1", "0RB0", "0B0", "0RB1", "0B1"],
        ["1RF0", "1F0", "1SF0", "1RF1", "1F1", "1SF1", "1RB0", "1B0", "1SB0", "1RB1", "1B1", "1SB1"],
        ["2RF0", "2F0", "2RF1", "2F1", "2B0", "2SB0", "2B1", "2SB1"],
    ]


def test_1f1b_order_literal() -> None:
    compute = [" ".join(row) for row in one_f_one_b(3, 4).compute_only().to_strings()]
    assert compute == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_eager_1f1b_runs_one_more_warm_up_forward_on_every_stage_but_the_last() -> None:
    compute = [" ".join(row) for row in one_f_one_b(3, 4, eager=True).compute_only().to_strings()]
    assert compute == [
        "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        "1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]
    eager = for_plan(Plan((0, 2, 3), ("swap", "recompute", "keep"), 6, "eager-1f1b"))
    assert eager.name == "eager-1f1b"
    eager.validate()  # runs to the end: no deadlock, swaps and recomputes included
    for k, m in ((2, 1), (2, 8), (4, 3), (5, 16)):
        one_f_one_b(k, m, eager=True).validate()


def test_policies_become_swap_and_recompute_actions() -> None:
    plan = Plan((0, 2, 3), ("swap", "recompute", "keep"), 2, "1f1b")
    rows = for_plan(plan).to_strings()
    # Swap-outs follow each forward; each swap-in is issued one compute step ahead of its backward (prefetch);
    # recomputes run right before their backward.
    assert rows[0] == ["0F0", "0SO0.0", "0SF0", "0SI0.0", "0F1", "0SO1.0", "0SF1", "0SI1.0", "0RB0", "0RC0.1", "0B0",
                       "0RB1", "0RC1.1", "0B1"]
    for_plan(plan).validate()


def test_parse_and_validate_accept_generated_schedules() -> None:
    for sched in (gpipe(4, 6), one_f_one_b(4, 6), one_f_one_b(3, 1), gpipe(1, 3)):
        again = Schedule.parse([" ".join(r) for r in sched.to_strings()], sched.microbatches)
        assert again.to_strings() == sched.to_strings()
        again.validate()


def test_validate_marks_a_backward_before_its_forward() -> None:
    bad = Schedule.parse(["0B0 0F0"], 1)
    with pytest.raises(ScheduleError) as err:
        bad.validate()
    text = str(err.value)
    assert "0B0 comes too early" in text
    assert ">>0B0<<" in text and "stage 0:" in text


def test_validate_reports_missing_and_foreign_actions() -> None:
    with pytest.raises(ScheduleError, match="never runs 0B1"):
        Schedule.parse(["0F0 0B0 0F1"], 2).validate()
    with pytest.raises(ScheduleError, match="belongs to stage 1"):
        Schedule.parse(["1F0 1B0"], 1).validate()
    with pytest.raises(ScheduleError, match="no neighbour"):
        Schedule.parse(["0F0 0SF0 0B0"], 1).validate()
    with pytest.raises(ScheduleError, match="never swapped back in"):
        Schedule.parse(["0F0 0SO0.0 0B0"], 1).validate()


def test_validate_detects_deadlock_with_grid() -> None:
    # Stage 0 waits for micro-batch 0's gradient before sending micro-batch 1, which stage 1 needs first.
    rows = [
        "0F0 0SF0 0RB0 0B0 0F1 0SF1 0RB1 0B1",
        "1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1 1SB1",
    ]
    sched = Schedule.parse(rows, 2)
    with pytest.raises(ScheduleError) as err:
        sched.validate()
    text = str(err.value)
    assert "deadlocks" in text and "stage 0 waits at 0RB0" in text and "stage 1 waits at 1RF1" in text
    assert ">>0RB0<<" in text


def test_weight_steps_parse_and_are_checked() -> None:
    assert Action.parse("1W3") == Action(1, Op.W, 3)
    with pytest.raises(ScheduleError, match="comes too early: it needs the backward"):
        Schedule.parse(["0F0 0W0 0B0"]).validate()
    with pytest.raises(ScheduleError, match=r"never runs 0W1: every stage runs F and B \(and W"):
        Schedule.parse(["0F0 0F1 0B0 0W0 0B1"]).validate()
    Schedule.parse(["0F0 0F1 0B0 0B1 0W1 0W0"]).validate()  # W in any order after its own B
