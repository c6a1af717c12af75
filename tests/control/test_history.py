"""The record of a session (control/history.py): an entry per plan in force, what it measured against what was
predicted, splits kept once the span window has rolled past them, and two entries side by side."""

from __future__ import annotations

import threading

import pytest

from vpipe_lab.control.history import KEEP, History
from vpipe_lab.control.state import JobState
from vpipe_lab.core.change import Applied
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.timeline import Span
from vpipe_lab.telemetry.metrics import Metrics

FIRST, SECOND = Plan.from_counts([2, 2], 2), Plan.from_counts([1, 3], 2)


def run(state: JobState, metrics: Metrics, history: History, iterations: range, stage1_s: float) -> None:
    """Iterations whose stage 1 computes ``stage1_s`` of each 1-second iteration (stage 0: 0.25 s)."""
    for it in iterations:
        t = float(it)
        spans = [Span(0, "forward", 0, None, t, t + 0.25, it), Span(1, "forward", 0, None, t, t + stage1_s, it),
                 Span(1, "send", 0, None, t + stage1_s, t + 1.0, it)]
        metrics.add({"iteration": it, "time_s": 1.0 + 0.01 * it, "end_s": t + 1.0, "samples_per_s": 8.0,
                     "plan_version": 0}, spans, [])
        state.iteration = it + 1
        history.observe({"type": "iteration", "iteration": it})


def test_each_plan_in_force_is_an_entry_with_what_it_measured_and_was_predicted() -> None:
    state, metrics = JobState(), Metrics(span_window=5)
    history = History(state, metrics, threading.Condition())
    assert history.frame().empty
    state.first = Applied(FIRST, 0, 0, source="launch")
    run(state, metrics, history, range(0, 10), stage1_s=0.75)
    state.applied.append(Applied(SECOND, 1, 10, moves=1, pause_s=0.02, source="editor", predicted_s=0.8))
    run(state, metrics, history, range(10, 30), stage1_s=0.5)  # the window (5 iterations) rolled past entry 0 long ago
    rows = history.rows()
    assert [r["source"] for r in rows] == ["launch", "editor"] and [r["entry"] for r in rows] == [0, 1]
    assert (rows[0]["from_iteration"], rows[0]["to_iteration"], rows[0]["iterations"]) == (0, 10, 10)
    assert (rows[1]["from_iteration"], rows[1]["to_iteration"], rows[1]["iterations"]) == (10, None, 20)
    assert rows[0]["median_s"] == pytest.approx(1.045) and rows[1]["median_s"] == pytest.approx(1.195)
    assert rows[0]["predicted_s"] is None and rows[1]["error"] == pytest.approx(1.195 / 0.8 - 1)
    assert rows[0]["bottleneck"] == 1 and rows[1]["moves"] == 1 and rows[1]["samples_per_s"] == 8.0
    both = history.compare(0, 1)
    # entry 0's split was kept when entry 1 took over: stage 1 computed 75% of its iterations, then 50%
    assert list(both["stage"]) == [0, 1]
    assert both["compute_share_0"][1] == pytest.approx(0.75) and both["compute_share_1"][1] == pytest.approx(0.5)
    assert both["transfer_share_0"][1] == pytest.approx(0.25) and both["bottleneck_0"][1]
    assert both["median_s_1"][0] == pytest.approx(1.195)
    last = history.split(history.entry(0))[1]
    assert last is not None and {s.iteration for s in last} == {9}
    with pytest.raises(ValueError, match=r"no entry 2 in the session's record: entries are 0\.\.1"):
        history.entry(2)


def test_only_the_newest_entries_keep_their_spans() -> None:
    state, metrics = JobState(), Metrics(span_window=5)
    history = History(state, metrics, threading.Condition())
    state.first = Applied(FIRST, 0, 0, source="launch")
    for n in range(KEEP + 3):
        run(state, metrics, history, range(2 * n, 2 * n + 2), stage1_s=0.5)
        state.applied.append(Applied(SECOND if n % 2 else FIRST, n + 1, 2 * n + 2, source="api"))
    run(state, metrics, history, range(2 * KEEP + 6, 2 * KEEP + 7), stage1_s=0.5)
    entries = history.entries()
    assert all(e.last is None and e.split is not None for e in entries[:3])  # rows and splits stay, spans go
    assert all(e.last is not None for e in entries[-KEEP:-1])


def test_recent_are_the_plan_in_force_newest_iterations_after_it_settled() -> None:
    state, metrics = JobState(), Metrics(span_window=5)
    history = History(state, metrics, threading.Condition())
    assert history.recent(20, 2) == []
    state.first = Applied(FIRST, 0, 0, source="launch")
    run(state, metrics, history, range(0, 30), stage1_s=0.75)
    assert [t for _, t in history.recent(5, 2)] == pytest.approx([1.0 + 0.01 * it for it in range(25, 30)])
    state.applied.append(Applied(SECOND, 1, 30, source="editor"))
    run(state, metrics, history, range(30, 34), stage1_s=0.5)
    # the old plan's iterations are not the running plan's, and its first two (the migration's) are left out
    assert history.recent(20, 2) == [(33.0, pytest.approx(1.32)), (34.0, pytest.approx(1.33))]  # (end, seconds)
