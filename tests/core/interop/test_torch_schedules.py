"""The lab's schedules in torch.distributed.pipelining's words, checked against the installed torch itself: its action
parser reads every row, its schedule validation accepts every order, and each ``exact`` rule says precisely when
torch's own class builds the lab's order."""

from __future__ import annotations

import logging
from unittest import mock

import pytest
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _Action,
    _validate_schedule,
    get_schedule_class,
)
from torch.distributed.pipelining.stage import PipelineStage

from vpipe_lab.core import schedules
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.interop import torch_schedules
from vpipe_lab.core.plan import Plan, Policy


def plan_of(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> Plan:
    chunks = stages * virtual
    return Plan(tuple(range(chunks + 1)), (Policy.KEEP,) * chunks, microbatches, schedule, virtual)


def torch_order(name: str, stages: int, microbatches: int, virtual: int) -> list[list[str]] | None:
    """The compute order torch's class ``name`` builds (its ``pipeline_order``), for a multi-stage class; None if
    torch refuses the shape."""
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, stages, None, stages * virtual
    logging.disable(logging.WARNING)
    try:
        built = get_schedule_class(name)([stage] * virtual, microbatches)
    except (ValueError, AssertionError):
        return None
    finally:
        logging.disable(logging.NOTSET)
    def flat(actions: list) -> list:  # an overlapped pair (DualPipeV's) is its forward and its backward, in order
        return [s for a in actions if a is not None for s in (a.sub_actions or (a,))]

    return [[str(a) for a in flat(built.pipeline_order[r]) if a.computation_type.value in "FBIW"]
            for r in range(stages)]


def test_rows_are_torch_actions_and_torch_validates_every_order() -> None:
    for schedule in torch_schedules.torch_classes():
        for k in (2, 3, 4):
            for m in (1, 2, 3, 4, 6, 8):
                virtual = schedules.get(schedule).default_virtual
                try:
                    plan = plan_of(schedule, k, m, virtual).validate()
                except PlanError:
                    continue  # interleaved needs micro-batches in groups of the stages
                rows = torch_schedules.rows(plan)
                actions = {r: [_Action.from_str(a) for a in row] for r, row in enumerate(rows)}
                assert [[str(a) for a in row] for row in actions.values()] == rows
                mapping = _validate_schedule(actions, k, k * virtual, m)  # torch's own check; raises if invalid
                assert [mapping[s] for s in range(k * virtual)] == torch_schedules.rank_of_stage(plan)


def test_dualpipev_is_torchs_own_order_with_its_whole_backwards() -> None:
    """DualPipeV pairs one chunk's forward with the other's whole backward: torch's ``B`` (not ``I`` and ``W``)
    where its backward is whole, ``I`` ... ``W`` where it is split, as torch's class orders them."""
    plan = plan_of("dualpipev", 2, 4, 2).validate()
    rows = torch_schedules.rows(plan)
    assert rows == torch_order("DualPipeV", 2, 4, 2)
    assert torch_schedules.torch_name(plan) == "DualPipeV" and torch_schedules.style(plan) == "v"
    letters = {cell[1] for row in rows for cell in row}
    assert letters == {"F", "B", "I", "W"}


def test_the_csv_is_what_torch_reads() -> None:
    plan = plan_of("zbv", 2, 4, 2)
    text = torch_schedules.csv_text(plan)
    assert text.splitlines()[0].startswith("0F0,0F1,0F2,3F0,3I0,3W0")
    assert torch_schedules.read_csv(text) == torch_schedules.rows(plan)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv", "zb-h1", "dualpipev"])
def test_each_exact_rule_is_torchs_own_order(schedule: str) -> None:
    """Over many shapes: torch's class builds the lab's order exactly where the rule says, and only there."""
    name = torch_schedules.torch_classes()[schedule].name
    checked = 0
    for k in range(2, 6):
        for m in range(1, 17):
            for virtual in ((2, 3) if schedule == "interleaved-1f1b" else (2,) if schedules.get(schedule).chunked
                            else (1,)):
                try:
                    plan = plan_of(schedule, k, m, virtual).validate()
                except PlanError:
                    continue
                theirs = torch_order(name, k, m, virtual)
                if theirs is None:
                    assert torch_schedules.torch_name(plan) is None, (k, m, virtual)
                    continue
                same = theirs == torch_schedules.rows(plan)
                assert same == (torch_schedules.torch_name(plan) == name), (schedule, k, m, virtual, same)
                checked += 1
    assert checked > 20


def test_single_stage_classes_and_what_cannot_be_exported() -> None:
    """GPipe's order is torch's at every shape (its ``pipeline_order``); 1F1B's class refuses fewer micro-batches
    than stages (its order is checked against a real two-rank run in tests/integration/test_export.py)."""
    for k in (2, 3, 4):
        for m in (1, 2, 4, 8):
            plan = plan_of("gpipe", k, m)
            assert torch_schedules.torch_name(plan) == "GPipe"
            theirs = get_schedule_class("GPipe")
            assert issubclass(theirs, PipelineScheduleSingle)
            assert (torch_schedules.torch_name(plan_of("1f1b", k, m)) == "1F1B") == (m >= k)
    assert torch_schedules.torch_name(plan_of("eager-1f1b", 2, 4)) is None
    with pytest.raises(PlanError, match="pipedream-flush"):
        torch_schedules.torch_name(plan_of("pipedream", 2, 4))


def test_a_csv_is_matched_to_the_lab_schedule_that_runs_it() -> None:
    plan = plan_of("eager-1f1b", 2, 4)
    candidates = [plan_of(s, 2, 4) for s in ("gpipe", "1f1b", "eager-1f1b", "zb-h1")]
    assert torch_schedules.schedule_of_rows(torch_schedules.rows(plan), candidates) == plan
    assert torch_schedules.schedule_of_rows([["0F0"], ["1F0"]], candidates) is None
