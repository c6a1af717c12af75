"""The Session's record as the user sees it (control/record.py): a revert is a live change of source "revert"; one
the pipeline cannot run is refused before anything is asked of the workers."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from vpipe_lab.control.history import History
from vpipe_lab.control.record import Record
from vpipe_lab.control.state import JobState
from vpipe_lab.core.change import Applied, Change
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Plan
from vpipe_lab.telemetry.metrics import Metrics


class Recorded(Record):
    def __init__(self, stages: int) -> None:
        self.state, self.stages, self.asked = JobState(), stages, []  # type: list[Change]
        super().__init__(History(self.state, Metrics(), threading.Condition()), self.change, lambda: self.stages)

    def change(self, change: Change, **kw: Any) -> Applied:
        self.asked.append(change)
        done = Applied(change.on(self.state.plan), len(self.state.applied) + 1, 5, source=change.source)
        self.state.applied.append(done)
        return done


def test_revert_asks_for_the_entry_plan_as_a_revert() -> None:
    s = Recorded(2)
    s.state.plan = Plan.from_counts([2, 2], 2)
    s.state.first = Applied(s.state.plan, 0, 0, source="launch")
    s.state.applied.append(Applied(Plan.from_counts([1, 3], 2), 1, 3, source="editor"))
    done = s.revert(0)
    assert s.asked[0].source == "revert" and done.plan.boundaries == (0, 2, 4)
    assert list(s.history["source"]) == ["launch", "editor", "revert"]


def test_an_entry_on_another_stage_count_is_refused() -> None:
    s = Recorded(1)  # a stage could not come back since entry 0 ran
    s.state.first = Applied(Plan.from_counts([2, 2], 2), 0, 0, source="launch")
    with pytest.raises(PlanError, match="entry 0 ran on 2 stages and the pipeline has 1 now"):
        s.revert(0)
    with pytest.raises(ValueError, match="no entry 3"):
        s.revert(3)
    assert s.asked == []
