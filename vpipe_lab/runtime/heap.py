"""Giving freed memory back to the system between iterations, so a worker's resident memory stays flat for days.

Each iteration allocates and frees many short-lived buffers (activations, gradients, messages) from several threads
(the compute thread, gloo's and ZeroMQ's); glibc keeps freed blocks in its arenas, and fragmentation makes resident
memory creep up by a few KiB per iteration although nothing is kept (``benchmarks/flat_memory.py``: 1.3-2.9 KiB per
iteration on gpt-tiny, nearly all of it returned by ``malloc_trim``). At an iteration boundary, at most once every
``every_s`` seconds, ``Trimmer.maybe`` asks glibc to return what is free. Elsewhere (macOS, musl) it does nothing.
With ``VPIPE_LAB_HEAP_LOG=S`` in its environment a worker also logs a ``census`` every S seconds after a trim: resident
memory beside what malloc has handed out and still holds free, so growth can be told apart as kept (a leak) or
fragmentation (``benchmarks/flat_memory.py --heap``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import threading
import time
import tracemalloc
import types
from collections import Counter
from collections.abc import Callable

import psutil

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2() -> Callable[[], _Mallinfo2] | None:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2  # glibc 2.33+; sums every arena
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = [], _Mallinfo2
    return fn  # type: ignore[no-any-return]


def _kind(obj: object) -> str:
    """An object's type; a function's or method's own name too (closures and bound methods are what cycles hold)."""
    try:
        func = getattr(obj, "__func__", obj)
    except Exception:  # an object whose __getattr__ raises KeyError (attribute dicts do): its type says enough
        func = obj
    if isinstance(func, types.FunctionType):
        return f"{type(obj).__qualname__} {func.__module__}.{func.__qualname__}"
    return type(obj).__qualname__


def collect_garbage() -> tuple[int, Counter[str]]:
    """A full garbage collection that counts what it found unreachable, by type (what makes reference cycles)."""
    flags = gc.get_debug()
    gc.set_debug(flags | gc.DEBUG_SAVEALL)  # the unreachable go to gc.garbage instead of being freed, to be counted
    try:
        found = gc.collect()
        kinds = Counter(_kind(o) for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(flags)
    gc.collect()  # and now freed
    return found, kinds


def census() -> dict[str, int]:
    """This process's memory in parts, bytes: ``rss``; what malloc has handed out (``malloc_used``, mmapped blocks
    included) and holds free (``malloc_free``); Python's tracked objects and threads; what tracemalloc traces (when
    on). Growing ``malloc_used`` is memory kept; ``rss`` growing alone is fragmentation. -1 where glibc is absent.
    Python's objects count includes cycles waiting for the next full collection unless one just ran
    (``collect_garbage``, as the census ``Trimmer`` logs does)."""
    info = _mallinfo2()
    m = info() if info is not None else None
    return {
        "rss": psutil.Process().memory_info().rss,
        "malloc_used": m.uordblks + m.hblkhd if m is not None else -1,
        "malloc_free": m.fordblks if m is not None else -1,
        "py_objects": len(gc.get_objects()),
        "threads": threading.active_count(),
        "traced": tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else -1,
    }


def census_every() -> float:
    """Seconds between census lines from ``VPIPE_LAB_HEAP_LOG`` (unset, empty or not a positive number: never)."""
    raw = os.environ.get("VPIPE_LAB_HEAP_LOG", "")
    try:
        return max(float(raw), 0.0) if raw else 0.0
    except ValueError:
        log.warning("VPIPE_LAB_HEAP_LOG=%r is not a number of seconds; no heap census", raw)
        return 0.0


class Trimmer:
    """Calls glibc's ``malloc_trim(0)`` at most once every ``every_s`` seconds (0 or less: never), before it a full
    garbage collection at most once every ``collect_s`` seconds (0: never), and logs a ``census`` after it at most
    once every ``census_s`` seconds (0: never)."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 census_s: float | None = None, collect_s: float = 60.0) -> None:
        self.every_s, self.clock, self.collect_s = every_s, clock, collect_s
        self.trim = _malloc_trim() if every_s > 0 else None
        self.last = self.last_collect = clock()
        self.count = self.collections = 0
        self.collect_cost_s = 0.0  # the newest full collection's time
        self.census_s = census_every() if census_s is None else census_s
        self.last_census = -float("inf")
        self.types: Counter[str] | None = None  # Python objects by type at the previous census
        self.traces: tracemalloc.Snapshot | None = None  # with PYTHONTRACEMALLOC set: the first census's

    def maybe(self, iteration: int = -1) -> bool:
        """Trim if it is time, after a full garbage collection if that is due too; True when it did."""
        now = self.clock()
        if self.every_s <= 0 or now - self.last < self.every_s:
            return False
        if self.collect_s > 0 and now - self.last_collect >= self.collect_s:
            # Python's own full collection waits for a quarter more objects than the process holds (~300,000 in a
            # worker): hours for the few cycles an iteration leaves (torch's tree_flatten makes one per call), which
            # RSS showed as ~60 B per iteration. Every minute; what it cost is in the census (collect_us).
            began = time.perf_counter()
            gc.collect()
            self.collect_cost_s = time.perf_counter() - began
            self.last_collect, self.collections = now, self.collections + 1
        if self.trim is not None:
            self.trim(0)
        self.last = self.clock()
        self.count += 1
        if self.census_s > 0 and self.last - self.last_census >= self.census_s:
            self.last_census = self.last
            found, kinds = collect_garbage()
            parts = " ".join(f"{k}={v}" for k, v in {"garbage": found, "collect_us": int(self.collect_cost_s * 1e6),
                                                       **census()}.items())
            log.info("heap census: iteration=%d %s", iteration, parts)
            if kinds:  # cycles that waited for a full collection, and whatever they held (tensors too)
                log.info("heap census: garbage by type: %s",
                         ", ".join(f"{k} {n}" for k, n in kinds.most_common(12)))
            self._types_grown()
        return True

    def _types_grown(self) -> None:
        """Log the object types whose count grew most since the previous census (what a Python leak is made of)."""
        counts = Counter(type(o).__qualname__ for o in gc.get_objects())
        if self.types is not None:
            grown = (counts - self.types).most_common(8)
            if grown:
                log.info("heap census: objects grown by type: %s", ", ".join(f"{k} +{n}" for k, n in grown))
        self.types = counts
        if tracemalloc.is_tracing():  # PYTHONTRACEMALLOC=N: where Python's allocations grew since the first census
            traces = tracemalloc.take_snapshot()
            if self.traces is None:
                self.traces = traces  # the baseline: what keeps growing past it is kept, what comes and goes is not
            else:
                for stat in traces.compare_to(self.traces, "traceback")[:6]:
                    log.info("heap census: %+d B in %+d blocks since the first census, at %s", stat.size_diff,
                             stat.count_diff, " <- ".join(str(f) for f in stat.traceback))
