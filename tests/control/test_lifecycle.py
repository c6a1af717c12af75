"""The Session's processes and restarts as the user sees them."""

from __future__ import annotations

import pytest

from vpipe_lab.control.lifecycle import Lifecycle
from vpipe_lab.telemetry.metrics import Metrics


class Attached(Lifecycle):
    def __init__(self) -> None:
        self._launcher = self._job_dir = None
        self.metrics = Metrics()


def test_an_attached_session_has_no_processes_and_no_restarts_of_its_own() -> None:
    s = Attached()
    assert s.pids() == {} and s.remaining() == [] and s.exit_codes() == {} and s.restarts == []
    with pytest.raises(RuntimeError, match="torchrun's own --max-restarts"):
        s.restart_on_failure(1, 10.0)
    assert list(s.metrics.restarts.columns) == ["number", "time", "stage", "cause", "snapshot", "replayed", "seconds",
                                                "loss_diff"]
