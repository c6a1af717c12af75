from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from vpipe_lab.charts.figures import gantt_spec
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.timeline import Timeline
from vpipe_lab.core.workloads import random_chain
from vpipe_lab.jupyter.dashboard import Dashboard
from vpipe_lab.telemetry.metrics import Metrics, spans_from_wire


class FakeSession:
    """What the dashboard reads of a Session, fed with synthetic iterations."""

    def __init__(self) -> None:
        self.stages = 2
        self.replicas = 1
        self.settings = SimpleNamespace(budgets=(2**30, 2**30))
        self.metrics = Metrics()
        self.plan = Plan((0, 2, 4), "kkkk", 2)
        self.plan_version = 0
        self.iteration = 0
        self.status = "running"
        self.failure = None
        self.callbacks: list[Any] = []
        self.asked: list[bool] = []

    def memory(self, ask: bool = True) -> Any:
        """The planner's prediction per stage (200 and 300 bytes over a profile in hand)."""
        import pandas as pd

        self.asked.append(ask)
        return pd.DataFrame({"stage": [0, 1], "predicted_peak": [200 * 2**20, 300 * 2**20]})

    def on_event(self, cb: Any) -> Any:
        self.callbacks.append(cb)
        return lambda: self.callbacks.remove(cb)

    def step(self, it: int) -> None:
        spans = spans_from_wire(0, it, [[0, 0, -1, it, it + 0.4, 0], [1, 0, -1, it + 0.5, it + 0.9, 0]])
        spans += spans_from_wire(1, it, [[0, 0, -1, it + 0.4, it + 0.5, 0], [5, 0, -1, it + 0.5, it + 0.55, 0]])
        memory = [{"iteration": it, "stage": s, "params": 10, "grads": 10, "optimizer": 20, "static": 40, "resident": 100,
                   "activations": 120, "host": 0, **({"allocated_peak": 400} if s == 1 else {})} for s in range(2)]
        self.metrics.add({"iteration": it, "loss": 2.0 / (it + 1), "time_s": 1.0, "samples_per_s": float("nan"),
                          "grad_norm": 0.5, "lr": 0.01}, spans, memory)
        if it % 10 == 9:
            self.metrics.add_evaluation({"iteration": it + 1, "loss": 1.0, "batches": 1, "seconds": 0.1})
        self.iteration = it + 1
        for cb in list(self.callbacks):
            cb({"type": "iteration", "iteration": it})


def test_the_header_says_how_often_the_job_restarted() -> None:
    from vpipe_lab.control.workers.restarts import Restart

    s = FakeSession()
    board = Dashboard(s)  # type: ignore[arg-type]
    try:
        s.step(0)
        assert "restarts" not in board.header()["text"]
        s.metrics.add_restart(Restart(1, 0.0, 1, "the worker process was killed by signal 9 (SIGKILL: ...)", 40, 7,
                                      0.3))
        s.step(1)
        assert ("restarts: 1 (last: stage 1, the worker process was killed by signal 9; back to iteration 40, "
                "7 replayed)") in board.header()["text"]
        s.metrics.add_restart(Restart(2, 0.0, 2, "the worker process exited with code 1", 60, 3, 0.3, stages=2,
                                      note="stage 2 could not come back: ..."))
        s.step(2)
        assert ("restarts: 2 (last: stage 2, the worker process exited with code 1; back to iteration 60, 3 replayed; "
                "stage 2 could not come back: 2 stages now)") in board.header()["text"]
    finally:
        board.close()


def trace(panel: dict, name: str) -> dict:  # type: ignore[type-arg]
    return next(t for t in panel["data"] if t["name"] == name)


def test_refreshes_are_bounded_and_windows_roll() -> None:
    s = FakeSession()
    board = Dashboard(s, window=2, rate_hz=5)  # type: ignore[arg-type]
    try:
        start = time.monotonic()
        for it in range(60):
            s.step(it)
            time.sleep(0.01)
        time.sleep(0.5)
        elapsed = time.monotonic() - start
        assert 1 <= board.refreshes <= 5 * elapsed + 2  # never more than rate_hz, however fast iterations come
        view = board.widget
        assert view.frame >= board.refreshes  # one frame (one message) per refresh
        forward = trace(view.timeline, "forward")
        # 2 forward spans per iteration (one per stage), 3 entries each; only the last 2 iterations are drawn
        assert len(forward["x"]) == 3 * 2 * 2 and forward["x"][2] is None
        loss, rate, evals, norm = view.series["data"]
        assert loss["x"][-1] == 59 and rate["y"][-1] is None  # NaN drawn as a gap (NaN is not valid JSON)
        assert view.header["state"] == "running" and "iteration 60" in view.header["text"]
        assert "grad norm 0.5, lr 0.01" in view.header["text"]
        # stage 0 computes 0.8 of each 0.9 s window, stage 1 0.1 (and sends 0.05): stage 0 is what stage 1 waits for
        assert "bottleneck: stage 0 (compute 89%, waiting 11%; pipeline bubble 47%)" in view.header["text"]
        # the newest iteration's critical path: stage 0's forward then its backward (stage 1's send came too late)
        assert "critical path 900.00 ms through stages 0, 89% of it on stage 0" in view.header["text"]
        path = trace(view.timeline, "critical path")
        x = path["x"]
        assert path["y"] == [0.0] * 4 and [x[1] - x[0], x[2] - x[1], x[3] - x[2]] == pytest.approx([400, 100, 400])
        assert evals["x"] == [10, 20, 30, 40, 50, 60] and norm["y"][-1] == 0.5 and norm["showlegend"]
        memory = view.memory["data"]
        assert memory[0]["x"] == ["stage 0", "stage 1"] and memory[1]["y"][0] == pytest.approx(100 / 2**30)
        assert memory[3]["name"] == "budget" and memory[3]["y"] == [1.0, 1.0]
        # the bar's top is the allocator's peak where it was measured (stage 1), else the ledger's count (stage 0) ...
        assert memory[2]["y"] == pytest.approx([(160 - 140) / 2**30, (400 - 140) / 2**30])
        # ... and the planner's prediction stands beside it, read without asking the workers
        assert memory[5]["name"] == "predicted peak" and memory[5]["y"] == pytest.approx([200 / 1024, 300 / 1024])
        assert s.asked and not any(s.asked)
        json.dumps([view.header, view.timeline, view.memory, view.series], allow_nan=False)  # what the wire takes
    finally:
        board.close()


def test_a_display_sends_at_most_its_bytes_per_second() -> None:
    """However fast iterations come, a display's frames and the waits after them keep it within ``bytes_per_s``
    (over any stretch: what it sent is at most the budget's worth plus one frame)."""
    s = FakeSession()
    budget = 20_000.0
    board = Dashboard(s, window=3, rate_hz=10, bytes_per_s=budget)  # type: ignore[arg-type]
    try:
        start = time.monotonic()
        it = 0
        while time.monotonic() - start < 3.0:
            s.step(it)
            it += 1
            time.sleep(0.005)
        elapsed = time.monotonic() - start
        frame = board.widget.sent_bytes / max(1, board.refreshes)
        assert board.refreshes >= 2 and frame > budget / 10  # frames big enough that the byte bound, not the rate, binds
        assert board.widget.sent_bytes <= budget * elapsed + 2 * frame, (board.widget.sent_bytes, elapsed, frame)
        assert board.refreshes < 10 * elapsed / 2  # well under rate_hz: it waited for its bytes
    finally:
        board.close()
    with pytest.raises(ValueError, match="bytes_per_s must be positive"):
        Dashboard(FakeSession(), bytes_per_s=0)  # type: ignore[arg-type]


def test_simulated_timelines_use_the_same_drawing() -> None:
    s = FakeSession()
    board = Dashboard(s)  # type: ignore[arg-type]
    try:
        profile = random_chain(4, seed=2)
        from vpipe_lab.core.profile import Cluster

        timeline = simulate(s.plan, profile, Cluster(2, 10**12, 1e9, 1e9))
        fig = board.show_timeline(timeline)
        live = board.widget.timeline or gantt_spec(Timeline(), stages=2)
        assert [t.name for t in fig.data] == [t["name"] for t in live["data"]]
        frame = board.draw_timeline(timeline, title="what-if")
        assert board.widget.frame == frame and board.widget.timeline["layout"]["title"]["text"] == "what-if"
    finally:
        board.close()
    with pytest.raises(ValueError, match="rate_hz"):
        Dashboard(s, rate_hz=50)  # type: ignore[arg-type]


def test_every_replica_gets_its_own_lanes_and_bars() -> None:
    s = FakeSession()
    s.plan = s.plan.with_mesh(replicas=2)
    spans = spans_from_wire(0, 0, [[0, 0, -1, 0.0, 0.4, 0]]) + spans_from_wire(1, 0, [[0, 0, -1, 0.4, 0.5, 0]])
    spans += spans_from_wire(0, 0, [[0, 0, -1, 0.0, 0.3, 0]], replica=1) + spans_from_wire(1, 0, [[0, 0, -1, 0.3, 0.6, 0]],
                                                                                       replica=1)
    memory = [{"iteration": 0, "stage": st, "replica": r, "static": 40, "resident": 100, "activations": 120,
               "host": 0} for r in range(2) for st in range(2)]
    s.metrics.add({"iteration": 0, "loss": 1.0, "time_s": 0.6}, spans, memory)
    board = Dashboard(s)  # type: ignore[arg-type]
    try:
        board.refresh()
        layout = board.widget.timeline["layout"]
        assert layout["yaxis"]["ticktext"] == ["r0 stage 0", "r0 stage 1", "r1 stage 0", "r1 stage 1"]
        assert sorted(y for y in trace(board.widget.timeline, "forward")["y"] if y is not None) == [0, 0, 1, 1, 2, 2,
                                                                                                     3, 3]
        assert board.widget.memory["data"][0]["x"] == ["r0 stage 0", "r0 stage 1", "r1 stage 0", "r1 stage 1"]
    finally:
        board.close()


def test_the_view_stays_frozen_after_the_session_ends() -> None:
    s = FakeSession()
    board = Dashboard(s, rate_hz=10)  # type: ignore[arg-type]
    try:
        for it in range(3):
            s.step(it)
        s.status = "stopped"
        for cb in list(s.callbacks):
            cb({"type": "closed", "status": "stopped"})
        deadline = time.monotonic() + 5
        while board.widget.header.get("state") != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        header = board.widget.header
        assert header["state"] == "stopped" and "frozen" in header["text"] and "iteration 3" in header["text"]
        board._thread.join(timeout=5)
        assert not board._thread.is_alive() and s.callbacks == []  # no more refreshes, unsubscribed
        assert board.widget.comm is not None  # still on screen: not closed
        assert board.widget.series["data"][0]["x"] == [0, 1, 2]  # the last state is still drawn
    finally:
        board.close()


def test_a_failed_session_says_why() -> None:
    s = FakeSession()
    s.status = "failed"
    s.failure = SimpleNamespace(cause="stage 1: CUDA out of memory\ntraceback ...")
    board = Dashboard(s)  # type: ignore[arg-type]
    try:
        board.refresh()
        assert board.widget.header["state"] == "failed"
        assert board.widget.header["detail"] == "stage 1: CUDA out of memory"
    finally:
        board.close()


def test_a_wide_pipeline_draws_fewer_iterations_not_more_spans() -> None:
    s = FakeSession()
    board = Dashboard(s, window=3)  # type: ignore[arg-type]
    try:
        for it in range(5):  # 2 stages x 200 micro-batches x 2 kinds: 800 spans an iteration
            rows = [[k, mb, -1, it + mb * 1e-3, it + mb * 1e-3 + 5e-4, 0] for mb in range(200) for k in (0, 1)]
            spans = spans_from_wire(0, it, rows) + spans_from_wire(1, it, rows)
            s.metrics.add({"iteration": it, "loss": 1.0, "time_s": 1.0}, spans, [])
        board.refresh()
        drawn = sum(len([x for x in t["x"] if x is not None]) // 2 for t in board.widget.timeline["data"]
                    if t["name"] in ("forward", "backward"))
        assert drawn == 800  # one iteration (the newest); three would be 2,400
    finally:
        board.close()
