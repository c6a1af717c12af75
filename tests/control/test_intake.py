"""Message intake: per-stage reports become one iteration, answers reach their request, errors the monitor."""

import threading
from typing import Any

from tests import messages
from vpipe_lab.control.intake import Intake
from vpipe_lab.control.requests import Requests
from vpipe_lab.control.state import JobState
from vpipe_lab.control.subscriptions import Events
from vpipe_lab.control.workers.monitor import FailureMonitor
from vpipe_lab.telemetry.metrics import Metrics
from vpipe_lab.telemetry.sinks import Logger, open_sink
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.events import Ack, Evaluated, Failure


def report(stage: int, it: int, losses: list[float]) -> P.Message:
    memory = {"params": 1, "grads": 1, "optimizer": 2, "static": 4, "activations": 5, "resident": 5, "host": 0,
              "peak": 9, "budget": None}
    return messages.report(it, stage, start=10.0 + stage, end=11.0 + stage, losses=losses, memory=memory,
                           spans=[[0, 0, -1, 10.0, 10.5, 0]], samples=8, grad_norm=1.5, lr=0.1).message()


def make() -> tuple[Intake, JobState, Metrics, list[dict[str, Any]], list[tuple[Any, ...]]]:
    cond, state, metrics, events = threading.Condition(), JobState(), Metrics(), Events()
    logged: list[tuple[Any, ...]] = []
    logger = Logger(open_sink(lambda *a: logged.append(a)))
    monitor = FailureMonitor(None, None, state, events, cond)
    requests = Requests(None, 1.0, cond, lambda: None)
    seen: list[dict[str, Any]] = []
    events.subscribe(seen.append)
    intake = Intake(2, 1, state, metrics, requests, monitor, events, logger, cond)
    return intake, state, metrics, seen, logged


def test_an_iteration_counts_once_every_stage_reported_it() -> None:
    intake, state, metrics, _, logged = make()
    intake.receive(report(0, 0, []))
    assert state.iteration == 0 and metrics.latest() is None
    intake.receive(report(1, 0, [2.0, 4.0]))
    latest = metrics.latest()
    assert state.iteration == 1 and latest is not None and latest["loss"] == 3.0 and latest["grad_norm"] == 1.5
    assert len(metrics.latest_memory()) == 2 and logged  # the sink heard about it


def test_acks_answers_evaluations_and_errors_go_where_they_belong() -> None:
    intake, state, metrics, seen, _ = make()
    intake.receive(messages.ready(1).message())
    intake.receive(Ack(4, "pause", 3).message())
    intake.receive(Evaluated(1, iteration=3, loss=0.5, batches=1, seconds=0.1).message())
    intake.receive(Failure("migration", 1, version=2).message())
    assert 1 in state.ready
    assert metrics.evaluation_records()[-1]["loss"] == 0.5
    assert intake.monitor.refusals[2].stage == 1 and intake.monitor.fatal is None
    assert [e["type"] for e in seen] == ["ack", "error"]  # immediate; the evaluation waits for deliver()
    assert seen[0]["command"] == "pause" and seen[0]["iteration"] == 3
    intake.events.deliver()
    assert seen[-1]["type"] == "evaluated"


def test_a_malformed_message_is_dropped_with_its_field_named(caplog: Any) -> None:
    intake, state, metrics, seen, _ = make()
    body = messages.report(0, 0).to_dict()
    body["stage"] = "first"
    intake.receive(P.Message(P.ITERATION, "rank0", body))
    intake.receive(P.Message(P.ACK, "rank0", {"id": 4, "type": "pause", "iteration": 3}))  # the field is "command"
    assert metrics.latest() is None and seen == [] and state.iteration == 0
    text = caplog.text
    assert "iteration.stage must be a whole number, got 'first'" in text


def test_after_a_restart_replayed_iterations_are_recorded_once_and_compared() -> None:
    intake, state, metrics, seen, _ = make()
    for it in range(3):
        intake.receive(report(0, it, []))
        intake.receive(report(1, it, [2.0 + it]))
    intake.receive(report(0, 3, []))  # iteration 3 was under way when a worker died
    compared: list[tuple[int, float | None, float | None]] = []
    intake.on_replay = lambda it, loss, first: compared.append((it, loss, first))
    with intake.cond:
        intake.forget_partial()
    for it in range(1, 4):  # the replacements replay from the snapshot of iteration 1
        intake.receive(report(1, it, [2.0 + it]))
        intake.receive(report(0, it, []))
    assert [r["iteration"] for r in metrics.records()] == [0, 1, 2, 3] and state.iteration == 4
    assert compared == [(1, 3.0, 3.0), (2, 4.0, 4.0)]
    intake.events.deliver()
    assert [e["iteration"] for e in seen if e["type"] == "iteration"] == [0, 1, 2, 3]


def test_after_going_on_with_fewer_stages_an_iteration_is_whole_with_their_reports() -> None:
    intake, state, metrics, _, _ = make()
    intake.receive(report(0, 0, []))
    intake.receive(report(1, 0, [2.0]))
    with intake.cond:
        intake.forget_partial(1)  # stage 1 could not come back: one stage holds every layer and reports the loss
    intake.receive(report(0, 1, [3.0]))
    assert [r["iteration"] for r in metrics.records()] == [0, 1] and state.iteration == 2
    assert metrics.records()[-1]["loss"] == 3.0
