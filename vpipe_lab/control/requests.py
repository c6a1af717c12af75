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
from dataclasses import replace
from typing import TypeVar

from vpipe_lab.wire.channel import Endpoint
from vpipe_lab.wire.commands import Command
from vpipe_lab.wire.events import Ack, Evaluated, Layers, Tensors

Answer = TypeVar("Answer", Layers, Tensors, Evaluated)


class Requests:
    """The controller's side of the command protocol (see wire/commands.py and wire/events.py)."""

    def __init__(self, hub: Endpoint, timeout_s: float, cond: threading.Condition,
                 failure: Callable[[], Exception | None]) -> None:
        self.hub, self.timeout_s, self.cond, self._failure = hub, timeout_s, cond, failure
        self._ids = itertools.count(1)
        self._acks: dict[int, Ack] = {}
        self._replies: dict[int, list[Layers | Tensors | Evaluated]] = {}
        # Requests whose caller stopped waiting (its timeout): what still arrives for them is dropped, not kept.
        self._given_up: set[int] = set()
        self.restarts = 0  # the workers were replaced this many times (max_restarts): their requests die with them
        self.restarted_to = ""  # where the newest restart went back to, for the error a dropped request raises

    # --- the intake thread files what arrives (under ``cond``) ------------------------------------------------------
    def acknowledged(self, ack: Ack) -> None:
        if ack.id not in self._given_up:
            self._acks[ack.id] = ack

    def answered(self, answer: Layers | Tensors | Evaluated) -> None:
        if answer.id not in self._given_up:
            self._replies.setdefault(answer.id, []).append(answer)

    # --- callers -------------------------------------------------------------------------------------------------------
    def until(self, done: Callable[[], bool], timeout: float | None, what: str | Callable[[], str]) -> None:
        """Wait until ``done()`` (checked under ``cond``); raise the workers' failure, or TimeoutError saying ``what``
        (or what ``what()`` says when it expires: where things stood then) did not happen within ``timeout`` seconds
        (None: wait as long as it takes)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while not done():
                failure = self._failure()
                if failure is not None:
                    raise failure
                left = 0.1 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what() if callable(what) else what} within {timeout:g} s")
                self.cond.wait(min(left, 0.1))

    def settle(self, done: Callable[[], bool], timeout: float) -> None:
        """Give ``done()`` up to ``timeout`` seconds (the reports of the iterations before a pause the workers
        reported, which travel on other sockets than the pause), and go on either way."""
        try:
            self.until(done, timeout, "the reports before the pause")
        except TimeoutError:
            pass

    def send(self, cmd: Command) -> int:
        """Send a command to rank 0; returns the id it was sent with."""
        cid = next(self._ids)
        self.hub.send("rank0", replace(cmd, id=cid).message())  # type: ignore[type-var]
        return cid

    def replaced(self, where: str) -> None:
        """The workers were replaced (under ``cond``): whoever waits on the old ones' answers hears it now."""
        self.restarts += 1
        self.restarted_to = where
        self.cond.notify_all()

    def _answered_by(self, cmd: Command, done: Callable[[], bool]) -> Callable[[], bool]:
        """``done``, raising if the workers asked were replaced before it came true."""
        epoch = self.restarts

        def check() -> bool:
            if done():
                return True
            if self.restarts != epoch:
                raise RuntimeError(f"the workers were replaced before they answered {cmd.TYPE!r} (a worker failed; "
                                   f"the pipeline went back to {self.restarted_to}): check the session's state and ask "
                                   "again")
            return False

        return check

    def _await(self, cid: int, done: Callable[[], bool], timeout: float | None, what: str) -> None:
        """``until`` for request ``cid``; a caller that gives up (any error) leaves nothing of it behind."""
        try:
            self.until(done, self.timeout_s if timeout is None else timeout, what)
        except BaseException:
            with self.cond:
                self._given_up.add(cid)
                self._acks.pop(cid, None)
                self._replies.pop(cid, None)
            raise

    def command(self, cmd: Command, timeout: float | None = None) -> Ack:
        """Send a command and return rank 0's acknowledgement."""
        cid = self.send(cmd)
        self._await(cid, self._answered_by(cmd, lambda: cid in self._acks), timeout,
                    f"rank 0 did not acknowledge {cmd.TYPE!r} (it acts at the next iteration boundary, so a long "
                    "iteration delays it)")
        with self.cond:
            return self._acks.pop(cid)

    def gather(self, cmd: Command, answer: type[Answer], answers: int, timeout: float | None = None
               ) -> list[Answer]:
        """A command ``answers`` stages answer with ``answer`` bodies; returns them ordered by stage."""
        cid = self.send(cmd)
        self._await(cid, self._answered_by(cmd, lambda: len(self._replies.get(cid, [])) >= answers), timeout,
                    f"not every stage answered {cmd.TYPE!r}")
        with self.cond:
            replies = self._replies.pop(cid)
        typed = [r for r in replies if isinstance(r, answer)]
        if len(typed) < len(replies):
            raise TypeError(f"{cmd.TYPE!r} was answered with something other than {answer.__name__}")
        return sorted(typed, key=lambda r: r.stage)
