"""The Session's processes and restarts as the user sees them."""

from __future__ import annotations

import pytest

from vpipe_lab.control.lifecycle import Lifecycle, Processes
from vpipe_lab.control.state import JobState
from vpipe_lab.telemetry.metrics import Metrics


def test_an_attached_session_has_no_processes_and_no_restarts_of_its_own() -> None:
    """A session that attached to a torchrun job started no workers: no pids, exit codes or restarts of its own, and
    asking it to restart them says whose job that is."""
    import threading

    from vpipe_lab.control.lifecycle import Ranks

    metrics = Metrics()
    p = Processes(None, metrics, JobState())
    wiring = Lifecycle(None, Ranks(2, 1), None, None, None, JobState(), threading.Condition(), None, None,  # type: ignore[arg-type]
                       None, None, metrics, None, None)  # type: ignore[arg-type]
    assert p.pids() == {} and p.remaining() == [] and p.exit_codes() == {} and p.restarts == [] and p.started(0) == {}
    with pytest.raises(RuntimeError, match="torchrun's own --max-restarts"):
        wiring.restart_on_failure(1, 10.0)
    assert list(metrics.restarts.columns) == ["number", "time", "stage", "cause", "snapshot", "replayed", "seconds",
                                              "loss_diff"]


def test_a_restart_that_planned_a_stage_away_leaves_the_session_fewer_ranks_and_is_recorded() -> None:
    """What a restart that went on without a stage tells the Session: two stages of two pipelines, four ranks, where
    there were six; the restart in ``metrics.restarts`` and on the session's events."""
    import threading

    from vpipe_lab.control.lifecycle import Ranks
    from vpipe_lab.control.subscriptions import Events
    from vpipe_lab.control.workers.restarts import Restart
    from vpipe_lab.telemetry.sinks import Logger

    ranks, metrics, events = Ranks(3, 2), Metrics(), Events()
    wiring = Lifecycle(None, ranks, None, None, None, JobState(), threading.Condition(), None, None,  # type: ignore[arg-type]
                       None, None, metrics, Logger(None), events)  # type: ignore[arg-type]
    wiring.restarted(Restart(1, 0.0, 2, "SIGKILL", 10, 3, 1.5, stages=2, note="stage 2's layers went to stage 1"))
    assert (ranks.stages, ranks.workers) == (2, 4)
    seen: list[dict] = []  # type: ignore[type-arg]
    events.subscribe(seen.append)
    events.deliver()  # what the monitor thread does
    assert list(metrics.restarts["stage"]) == [2] and [(e["type"], e["stages"]) for e in seen] == [("restarted", 2)]
    wiring.restarted(Restart(2, 0.0, 0, "SIGKILL", 12, 0, 1.0))  # the same stages: nothing planned away
    assert ranks.stages == 2 and len(metrics.restarts) == 2


def test_the_device_and_the_layers_each_stage_holds_are_asked_of_the_processes() -> None:
    asked: list[float | None] = []
    p = Processes(None, Metrics(), JobState(), lambda timeout: asked.append(timeout) or [[0, 1], [2]])
    assert p.device == "?"  # rank 0 has not reported yet
    assert p.layers(5.0) == [[0, 1], [2]] and asked == [5.0]
    with pytest.raises(RuntimeError, match=r"session\.processes\.layers\(\)"):
        Processes(None, Metrics(), JobState()).layers()
