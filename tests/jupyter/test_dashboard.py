from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.simulator import simulate
from vpipe_lab.core.workloads import random_chain
from vpipe_lab.jupyter.dashboard import Dashboard
from vpipe_lab.telemetry.metrics import Metrics, spans_from_wire


class FakeSession:
    """What the dashboard reads of a Session, fed with synthetic iterations."""

    def __init__(self) -> None:
        self.stages = 2
        self.spec = SimpleNamespace(memory_budget=[2**30, 2**30])
        self.metrics = Metrics()
        self.plan = Plan((0, 2, 4), "kkkk", 2)
        self.plan_version = 0
        self.iteration = 0
        self.running = True
        self.status = "running"
        self.failure = None
        self.callbacks: list[Any] = []

    def on_event(self, cb: Any) -> Any:
        self.callbacks.append(cb)
        return lambda: self.callbacks.remove(cb)

    def step(self, it: int) -> None:
        spans = spans_from_wire(0, it, [[0, 0, -1, it, it + 0.4], [1, 0, -1, it + 0.5, it + 0.9]])
        spans += spans_from_wire(1, it, [[0, 0, -1, it + 0.4, it + 0.5], [5, 0, -1, it + 0.5, it + 0.55]])
        memory = [{"iteration": it, "stage": s, "params": 10, "grads": 10, "optimizer": 20, "static": 40, "resident": 100,
                   "activations": 120, "host": 0} for s in range(2)]
        self.metrics.add({"iteration": it, "loss": 2.0 / (it + 1), "time_s": 1.0, "samples_per_s": float("nan"),
                          "grad_norm": 0.5, "lr": 0.01}, spans, memory)
        if it % 10 == 9:
            self.metrics.add_evaluation({"iteration": it + 1, "loss": 1.0, "batches": 1, "seconds": 0.1})
        self.iteration = it + 1
        for cb in list(self.callbacks):
            cb({"type": "iteration", "iteration": it})


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
        forward = board.gantt.data[0]
        # 2 forward spans per iteration (one per stage), 3 entries each; only the last 2 iterations are drawn
        assert forward.name == "forward" and len(forward.x) == 3 * 2 * 2
        assert list(board.loss.data[0].x)[-1] == 59 and board.loss.data[1].y[-1] is None  # NaN drawn as a gap
        assert "iteration 60" in board.header.value and "grad norm 0.5, lr 0.01" in board.header.value
        assert list(board.loss.data[2].x) == [10, 20, 30, 40, 50, 60] and board.loss.data[3].y[-1] == 0.5
        assert board.memory.data[1].y[0] == pytest.approx(100 / 2**30)
    finally:
        board.close()


def test_simulated_timelines_use_the_same_drawing() -> None:
    s = FakeSession()
    board = Dashboard(s)  # type: ignore[arg-type]
    try:
        profile = random_chain(4, seed=2)
        from vpipe_lab.core.profile import Cluster

        timeline = simulate(s.plan, profile, Cluster(2, 10**12, 1e9, 1e9))
        fig = board.show_timeline(timeline)
        assert [t.name for t in fig.data] == [t.name for t in board.gantt.data]
        board.draw_timeline(timeline, title="what-if")
        assert board.gantt.layout.title.text == "what-if"
    finally:
        board.close()
    with pytest.raises(ValueError, match="rate_hz"):
        Dashboard(s, rate_hz=50)  # type: ignore[arg-type]


def test_the_view_stays_frozen_after_the_session_ends() -> None:
    s = FakeSession()
    board = Dashboard(s, rate_hz=10)  # type: ignore[arg-type]
    try:
        for it in range(3):
            s.step(it)
        s.status, s.running = "stopped", False
        for cb in list(s.callbacks):
            cb({"type": "closed", "status": "stopped"})
        deadline = time.monotonic() + 5
        while "session ended" not in board.header.value and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "session ended: stopped" in board.header.value and "frozen" in board.header.value
        assert "iteration 3" in board.header.value
        board._thread.join(timeout=5)
        assert not board._thread.is_alive() and s.callbacks == []  # no more refreshes, unsubscribed
        assert board.widget.comm is not None  # still on screen: not closed
        assert list(board.loss.data[0].x) == [0, 1, 2]  # the last state is still drawn
    finally:
        board.close()
