"""Session events: queued ones are delivered by whoever calls deliver(), immediate ones at once, in order."""

import logging

import pytest

from vpipe_lab.control.subscriptions import Events


def test_publish_queues_until_deliver_and_emit_is_immediate() -> None:
    events, seen = Events(), []
    unsubscribe = events.subscribe(seen.append)
    events.publish({"type": "iteration", "iteration": 0})
    events.publish({"type": "plan"})
    assert seen == []
    events.deliver()
    assert [e["type"] for e in seen] == ["iteration", "plan"]
    events.emit({"type": "ack"})
    assert seen[-1] == {"type": "ack"}
    unsubscribe()
    unsubscribe()  # idempotent
    events.emit({"type": "error"})
    assert len(seen) == 3


def test_a_broken_subscriber_is_logged_and_the_others_still_hear(caplog: pytest.LogCaptureFixture) -> None:
    events, seen = Events(), []

    def broken(event: dict[str, object]) -> None:
        raise RuntimeError("boom")

    events.subscribe(broken)
    events.subscribe(seen.append)
    with caplog.at_level(logging.ERROR):
        events.emit({"type": "closed"})
        events.emit({"type": "closed"})
    assert len(seen) == 2 and caplog.text.count("on_event callback raised") == 2
