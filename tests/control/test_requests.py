"""Requests: a command waits for rank 0's acknowledgement, answers are gathered by rank, every wait has a deadline."""

import threading
import time
from typing import Any

import pytest

from vpipe_lab.control.requests import Requests
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.codec import decode
from vpipe_lab.wire.commands import Pause, Profile, Run
from vpipe_lab.wire.events import Ack, Layers


class Hub:
    def __init__(self) -> None:
        self.sent: list[tuple[str, P.Message]] = []

    def send(self, to: str, msg: P.Message) -> None:
        self.sent.append((to, msg))

    def set_handler(self, handler: Any) -> None:
        pass

    def close(self) -> None:
        pass


def make(failure: Exception | None = None, timeout: float = 5.0) -> tuple[Requests, Hub, threading.Condition]:
    hub, cond = Hub(), threading.Condition()
    return Requests(hub, timeout, cond, lambda: failure), hub, cond


def later(cond: threading.Condition, action: Any, delay: float = 0.05) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        with cond:
            action()
            cond.notify_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_command_returns_its_own_acknowledgement() -> None:
    req, hub, cond = make()
    thread = later(cond, lambda: (req.acknowledged(Ack(99, "run", 1)), req.acknowledged(Ack(1, "pause", 7))))
    ack = req.command(Pause())
    thread.join(timeout=5)
    assert ack.iteration == 7 and ack.command == "pause"
    sent = hub.sent[0][1]
    assert hub.sent[0][0] == "rank0" and sent.type == P.PAUSE and decode(sent) == Pause(id=1)


def test_gather_orders_the_answers_by_rank() -> None:
    req, _, cond = make()

    def answer() -> None:
        for rank in (1, 0):
            req.answered(Layers(1, rank, []))

    thread = later(cond, answer)
    replies = req.gather(Profile(), Layers, answers=2)
    thread.join(timeout=5)
    assert [m.stage for m in replies] == [0, 1]


def test_waits_end_at_their_deadline_or_on_a_failure() -> None:
    req, _, _ = make(timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0 did not acknowledge 'run'.*within 0\.2 s"):
        req.command(Run())
    assert time.monotonic() - t0 < 2
    failing, _, _ = make(failure=RuntimeError("stage 1 died"))
    with pytest.raises(RuntimeError, match="stage 1 died"):
        failing.until(lambda: False, None, "never")
    ready, _, _ = make()
    ready.until(lambda: True, 0.0, "already true")  # no wait when it holds already


def test_a_request_the_replaced_workers_never_answered_fails_at_once() -> None:
    from vpipe_lab.wire.commands import Apply

    cond = threading.Condition()
    sent: list[object] = []
    requests = Requests(type("Hub", (), {"send": lambda self, to, msg: sent.append(msg)})(), 30.0, cond, lambda: None)
    threading.Timer(0.2, lambda: [cond.acquire(), requests.replaced("iteration 40, plan version 2"), cond.release()]).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"replaced before they answered 'apply' .*back to iteration 40, plan "):
        requests.command(Apply({}, 1))
    assert time.monotonic() - start < 5 and sent


def test_answers_that_arrive_after_their_caller_gave_up_are_dropped_not_kept() -> None:
    req, _, cond = make(timeout=0.05)
    with pytest.raises(TimeoutError, match="profile"):
        req.gather(Profile(), Layers, 2)
    with pytest.raises(TimeoutError, match="pause"):
        req.command(Pause())
    with cond:  # the late answers of both (ids 1 and 2) come in after all
        req.answered(Layers(1, 0, []))
        req.answered(Layers(1, 1, []))
        req.acknowledged(Ack(2, "pause", 3))
    assert req._replies == {} and req._acks == {}
    thread = later(cond, lambda: req.answered(Layers(3, 0, [])))  # a request after them is answered as ever
    assert [a.stage for a in req.gather(Profile(), Layers, 1, timeout=5)] == [0]
    thread.join(timeout=5)
