"""Session events for subscribers (dashboard, editor, auto-replanner, user callbacks), delivered off the hub thread.

Events about training (iterations, plan changes, evaluations, replans) are queued and delivered by the monitor thread,
so a slow subscriber never holds up message intake; acknowledgements and errors are delivered as they arrive.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
EventCallback = Callable[[dict[str, Any]], None]


class Events:
    """Subscribers and the queue of events not yet delivered to them."""

    def __init__(self) -> None:
        self._callbacks: list[EventCallback] = []
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def subscribe(self, callback: EventCallback) -> Callable[[], None]:
        """Call ``callback(event)`` for every event from now on; returns the unsubscribe function."""
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def publish(self, event: dict[str, Any]) -> None:
        """Queue ``event`` for the monitor thread to deliver (safe from any thread, cheap)."""
        with self._lock:
            self._pending.append(event)

    def deliver(self) -> None:
        """Deliver every queued event (the monitor thread calls this)."""
        with self._lock:
            events, self._pending = self._pending, []
        for event in events:
            self.emit(event)

    def emit(self, event: dict[str, Any]) -> None:
        """Deliver ``event`` now, on the calling thread."""
        for cb in list(self._callbacks):
            try:
                cb(event)
            except Exception:  # a broken callback must not take the session down with it
                log.exception("an on_event callback raised; it stays registered")
