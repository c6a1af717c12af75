"""Every Session this process started or attached, newest last: what the %vpipe magics act on when the notebook
started its session from Python (``vpipe_lab.launch(...)``) rather than with ``%vpipe start``."""

from __future__ import annotations

import threading
import weakref
from typing import Any

_SESSIONS: list[weakref.ref[Any]] = []
_LOCK = threading.Lock()


def register(session: Any) -> None:
    with _LOCK:
        _SESSIONS[:] = [ref for ref in _SESSIONS if ref() is not None]
        _SESSIONS.append(weakref.ref(session))


def latest(running: bool = True) -> Any | None:
    """The newest session that is not closed (with ``running=False``: the newest of any state)."""
    with _LOCK:
        alive = [s for s in (ref() for ref in _SESSIONS) if s is not None]
    for session in reversed(alive):
        if not running or not session.closed:
            return session
    return None
