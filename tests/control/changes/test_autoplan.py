import pytest

from vpipe_lab.control.changes.autoplan import AutoReplanner
from vpipe_lab.core.timeline import Span


class FakeSession:
    def __init__(self) -> None:
        self.callbacks = []  # type: ignore[var-annotated]

    def on_event(self, cb):  # type: ignore[no-untyped-def]
        self.callbacks.append(cb)
        return lambda: self.callbacks.remove(cb)


def test_triggers_periodic_drift_and_headroom() -> None:
    ar = AutoReplanner(FakeSession(), every=10, drift=0.2, headroom=0.1)  # type: ignore[arg-type]
    assert ar._trigger({"iteration": 3}, 3) == "periodic"
    ar._last, ar._predicted = 3, (1.0, 1.0)
    calm = {"microbatches": 2, "spans": [Span(0, "forward", 0, None, 0, 1.0), Span(0, "backward", 0, None, 1, 2.0),
                                         Span(1, "forward", 0, None, 0, 2.0)], "memory": []}
    assert ar._trigger(calm, 5) == ""
    slow = {**calm, "spans": [Span(1, "forward", 0, None, 0, 3.0)]}
    assert "stage 0 runs -100% off" in ar._trigger(slow, 5) or "stage 1 runs +50% off" in ar._trigger(slow, 5)
    tight = {**calm, "memory": [{"stage": 1, "peak": 95, "budget": 100}]}
    assert "stage 1 has under 10% memory headroom" == ar._trigger(tight, 5)
    assert ar._trigger(calm, 13) == "periodic"
    ar.stop()


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="auto_replan needs"):
        AutoReplanner(FakeSession(), every=0)  # type: ignore[arg-type]
