"""The Session's processes and restarts as the user sees them."""

from __future__ import annotations

import pytest

from vpipe_lab.control.lifecycle import Lifecycle, Processes
from vpipe_lab.control.state import JobState
from vpipe_lab.telemetry.metrics import Metrics


class Attached(Lifecycle):
    def __init__(self) -> None:
        self._launcher = self._job_dir = None
        self.metrics = Metrics()
        self.processes = Processes(None, self.metrics, JobState())


def test_an_attached_session_has_no_processes_and_no_restarts_of_its_own() -> None:
    s = Attached()
    p = s.processes
    assert p.pids() == {} and p.remaining() == [] and p.exit_codes() == {} and p.restarts == [] and p.started(0) == {}
    with pytest.raises(RuntimeError, match="torchrun's own --max-restarts"):
        s._restart_on_failure(1, 10.0)
    assert list(s.metrics.restarts.columns) == ["number", "time", "stage", "cause", "snapshot", "replayed", "seconds",
                                                "loss_diff"]


def test_the_device_and_the_layers_each_stage_holds_are_asked_of_the_processes() -> None:
    asked: list[float | None] = []
    p = Processes(None, Metrics(), JobState(), lambda timeout: asked.append(timeout) or [[0, 1], [2]])
    assert p.device == "?"  # rank 0 has not reported yet
    assert p.layers(5.0) == [[0, 1], [2]] and asked == [5.0]
    with pytest.raises(RuntimeError, match=r"session\.processes\.layers\(\)"):
        Processes(None, Metrics(), JobState()).layers()
