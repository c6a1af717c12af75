"""Request/reply with rank 0: commands, their acknowledgements and the answers every rank sends, under one deadline.

Commands go to rank 0, which broadcasts them to every rank at the next iteration boundary; rank 0 acknowledges with
the iteration at which a command took effect, and commands that gather data (profile, state, evaluation) are
answered by each rank. Every wait here goes through ``until``: it wakes on each incoming message, gives up on a
worker failure (raising it) and raises ``TimeoutError`` naming what it waited for at its deadline.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from vpipe_lab.wire import protocol as P


class Requests:
    """The controller's side of the command protocol (see wire/protocol.py)."""

    def __init__(self, hub: Any, timeout_s: float, cond: threading.Condition,
                 failure: Callable[[], Exception | None]) -> None:
        self.hub, self.timeout_s, self.cond, self._failure = hub, timeout_s, cond, failure
        self._ids = itertools.count(1)
        self._acks: dict[int, dict[str, Any]] = {}
        self._replies: dict[int, list[P.Message]] = {}

    # --- the intake thread files what arrives (under ``cond``) ------------------------------------------------------
    def acknowledged(self, body: dict[str, Any]) -> None:
        self._acks[int(body.get("id") or 0)] = body

    def answered(self, msg: P.Message) -> None:
        self._replies.setdefault(int(msg.body.get("id") or 0), []).append(msg)

    # --- callers -------------------------------------------------------------------------------------------------------
    def until(self, done: Callable[[], bool], timeout: float | None, what: str) -> None:
        """Wait until ``done()`` (checked under ``cond``); raise the workers' failure, or TimeoutError saying ``what``
        did not happen within ``timeout`` seconds (None: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not done():
                failure = self._failure()
                if failure is not None:
                    raise failure
                left = 0.1 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what} within {timeout:g} s")
                self.cond.wait(min(left, 0.1))

    def send(self, kind: str, body: dict[str, Any] | None = None) -> int:
        """Send a command to rank 0; returns its id."""
        cid = next(self._ids)
        self.hub.send("rank0", P.Message(kind, body={"id": cid, **(body or {})}))
        return cid

    def command(self, kind: str, body: dict[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        """Send a command and return rank 0's acknowledgement."""
        cid = self.send(kind, body)
        self.until(lambda: cid in self._acks, self.timeout_s if timeout is None else timeout,
                   f"rank 0 did not acknowledge {kind!r} (it acts at the next iteration boundary, so a long "
                   "iteration delays it)")
        with self.cond:
            return self._acks.pop(cid)

    def gather(self, kind: str, body: dict[str, Any] | None, answers: int, timeout: float | None = None
               ) -> list[P.Message]:
        """A command ``answers`` ranks answer; returns the answers ordered by rank."""
        cid = self.send(kind, body)
        self.until(lambda: len(self._replies.get(cid, [])) >= answers, self.timeout_s if timeout is None else timeout,
                   f"not every stage answered {kind!r}")
        with self.cond:
            replies = self._replies.pop(cid)
        return sorted(replies, key=lambda m: int(m.body["rank"]))
