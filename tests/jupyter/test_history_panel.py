"""The history panel (``%vpipe history``): the record as a table, Revert returns to an entry's plan without blocking
the kernel, Compare draws two entries side by side; all from a real record (control/history.py)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from vpipe_lab.control.history import History
from vpipe_lab.control.record import Record
from vpipe_lab.control.state import JobState
from vpipe_lab.core.change import Applied, Change
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.timeline import Span
from vpipe_lab.jupyter.history_panel import HistoryPanel, table_html
from vpipe_lab.telemetry.metrics import Metrics


class Recorded(Record):
    """A two-stage session's record, trained by hand; a change comes into force at the next iteration."""

    status = "running"

    def __init__(self) -> None:
        self.state, self.metrics, self.stages, self.callbacks = JobState(), Metrics(), 2, []  # type: ignore[var-annotated]
        super().__init__(History(self.state, self.metrics, threading.Condition()), self.change, lambda: self.stages)
        self.record = self  # the session's record is this Record (the Session answers history, revert, compare too)
        self.state.plan = Plan.from_counts([2, 2], 2)
        self.state.first = Applied(self.state.plan, 0, 0, source="launch")

    def on_event(self, cb: Any) -> Any:
        self.callbacks.append(cb)
        return lambda: self.callbacks.remove(cb) if cb in self.callbacks else None

    def publish(self, event: dict[str, Any]) -> None:
        for cb in list(self.callbacks):
            cb(event)

    def change(self, change: Change, **kw: Any) -> Applied:
        plan = change.on(self.state.plan)
        done = Applied(plan, len(self.state.applied) + 1, self.state.iteration, moves=1, source=change.source,
                       predicted_s=0.9)
        self.state.plan = plan
        self.state.applied.append(done)
        self.publish({"type": "plan"})
        return done

    def train(self, iterations: int, stage1_s: float) -> None:
        for _ in range(iterations):
            it, t = self.state.iteration, float(self.state.iteration)
            spans = [Span(0, "forward", 0, None, t, t + 0.2, it), Span(1, "forward", 0, None, t + 0.2, t + 0.2 + stage1_s,
                                                                         it)]
            self.metrics.add({"iteration": it, "time_s": 0.2 + stage1_s, "samples_per_s": 8.0}, spans, [])
            self.state.iteration = it + 1
            self.publish({"type": "iteration", "iteration": it})


def test_the_table_revert_and_compare() -> None:
    s = Recorded()
    s.train(5, 0.8)
    s.change(Change.of(boundaries=(0, 1, 4), source="editor"))
    s.train(5, 0.5)
    panel = HistoryPanel(s, period=0.0)  # type: ignore[arg-type]
    try:
        assert "<td>launch</td>" in panel.table.value and "<td>editor</td>" in panel.table.value
        assert "+0.0%" not in panel.table.value and "<td>-22.2%</td>" in panel.table.value  # 0.7 s against 0.9 s
        header = panel.view.header["text"]
        assert header.startswith("entry 0 (launch)") and "entry 1 (editor)" in header
        timeline = panel.view.timeline
        json.dumps(timeline, allow_nan=False)
        assert timeline["layout"]["yaxis"]["ticktext"][0] == "entry 0 · stage 0"  # both entries, one scale
        assert next(t["x"] for t in panel.view.memory["data"] if t["name"] == "compute")[0] == "stage 0 · entry 0"
        panel.pick.value = 0
        panel.revert_button.click()  # in a thread: the kernel is not held while the change comes into force
        deadline = time.monotonic() + 10
        while "in force from iteration" not in panel.status.value and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "entry 0's plan in force from iteration 10" in panel.status.value
        assert s.state.plan.boundaries == (0, 2, 4) and "<td>revert</td>" in panel.table.value
        panel.a.value, panel.b.value = 1, 2
        panel.compare_button.click()
        assert panel.view.header["text"].startswith("entry 1 (editor)")
        s.stages = 1  # a stage could not come back: entry 0 cannot run now, and the panel says why
        panel.revert_button.click()
        deadline = time.monotonic() + 10
        while "PlanError" not in panel.status.value and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "entry 0 ran on 2 stages and the pipeline has 1 now" in panel.status.value
    finally:
        panel.close()
    assert s.callbacks == []


def test_one_plan_so_far_says_how_to_get_two() -> None:
    s = Recorded()
    s.train(3, 0.5)
    panel = HistoryPanel(s)  # type: ignore[arg-type]
    try:
        assert "apply a change to compare two" in panel.view.header["text"]
        assert panel.view.series["data"][0]["x"] == ["0 launch"]
    finally:
        panel.close()


def test_the_table_marks_the_plan_in_force_and_shows_gaps_as_dashes() -> None:
    text = table_html([{"entry": 0, "source": "launch", "plan": "<p>", "from_iteration": 0, "to_iteration": None,
                        "iterations": 0, "median_s": None, "samples_per_s": float("nan"), "predicted_s": None,
                        "error": None, "bottleneck": None}])
    assert "font-weight:bold" in text and "&lt;p&gt;" in text and "<td>–</td>" in text
