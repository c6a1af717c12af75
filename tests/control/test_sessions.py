from __future__ import annotations

import gc

import pytest

from vpipe_lab.control import sessions


class Fake:
    def __init__(self) -> None:
        self.closed = False


def test_the_newest_running_session_is_the_one_to_act_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # A registry of its own: sessions of other tests in this process (pytest-xdist runs files in any order) may
    # still be referenced, by the magics' list for one.
    monkeypatch.setattr(sessions, "_SESSIONS", [])
    first, second = Fake(), Fake()
    sessions.register(first)
    sessions.register(second)
    assert sessions.latest() is second
    second.closed = True
    assert sessions.latest() is first and sessions.latest(running=False) is second
    first.closed = True
    assert sessions.latest() is None
    del first, second
    gc.collect()
    assert sessions.latest(running=False) is None  # held weakly: a forgotten session is not kept alive
