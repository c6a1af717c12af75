"""gloo's TCP event-loop thread on a pinned CPU worker's core, kept from preempting the posting of a transfer.

gloo's TCP pair has one lock for the thread that posts a send or receive and for gloo's own event-loop thread
(``gloo_tcp_loop``). A worker pinned to one core (``device.pin_cores``) shares that core with the loop thread: a
message arriving while the main thread is inside ``send``/``recv`` wakes the loop thread, which preempts the lock's
holder, fails its ``try_lock`` and spins on a level-triggered ``epoll_wait`` for its time slice while the holder waits
(1-5 ms stalls, measured on gpt-tiny's interleaved 1F1B: benchmarks/RESULTS.md). ``comm.Peer`` therefore posts inside
a ``QuietLoop``, which yields the core first (a loop thread already woken finishes before the lock is taken) and,
where the OS lets it, puts the loop threads in ``SCHED_IDLE`` for the few microseconds of the posting: an idle-policy
thread never preempts a normal one, so a message arriving then waits until the posts are out (the loop thread runs as
soon as the main thread waits or the window closes). Going back from ``SCHED_IDLE`` needs ``CAP_SYS_NICE`` or a high
enough ``RLIMIT_NICE``; a throwaway thread tries the round trip first, and without it only the yield is made (a
loop thread kept at low priority throughout delays every message: at nice 10 the same runs were 4% slower than leaving it
alone).
"""

from __future__ import annotations

import logging
import os
import threading
from types import TracebackType

log = logging.getLogger(__name__)

NAME = "gloo_tcp_loop"


def loop_threads() -> list[int]:
    """Thread ids of gloo's TCP event loops in this process (there after the process group is initialised)."""
    found = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux
        return []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == NAME:
                    found.append(int(tid))
        except OSError:  # a thread that ended meanwhile
            continue
    return found


def idle_round_trip_allowed() -> bool:
    """Whether this process may put a thread in ``SCHED_IDLE`` and take it back out (tried on a throwaway thread)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    result: list[bool] = []

    def attempt() -> None:
        try:
            policy = os.sched_getscheduler(0)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, policy, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    probe = threading.Thread(target=attempt, name="vpipe-sched-probe", daemon=True)
    probe.start()
    probe.join(timeout=5)
    return bool(result and result[0])


class QuietLoop:
    """A context manager: the core yielded on entering, then gloo's loop threads at idle priority inside, as they
    were outside. Only the yield where the round trip is not allowed or no loop thread is found."""

    def __init__(self) -> None:
        self._threads: list[tuple[int, int]] | None = None  # (tid, its own policy), found at the first use

    @property
    def threads(self) -> list[tuple[int, int]]:
        if self._threads is None:
            self._threads = []
            if idle_round_trip_allowed():
                for tid in loop_threads():
                    try:
                        self._threads.append((tid, os.sched_getscheduler(tid)))
                    except OSError:
                        continue
            log.info("gloo loop threads kept quiet while posting: %s", [tid for tid, _ in self._threads] or "none")
        return self._threads

    def __enter__(self) -> None:
        os.sched_yield()
        for tid, _ in self.threads:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:  # the thread ended (the process group was destroyed)
                continue

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for tid, policy in self.threads:
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except OSError:
                continue
