"""Giving freed memory back to the system between iterations, so a worker's resident memory stays flat for days.

Each iteration allocates and frees many short-lived buffers (activations, gradients, messages) from several threads
(the compute thread, gloo's and ZeroMQ's); glibc keeps freed blocks in its arenas, and fragmentation makes resident
memory creep up by a few KiB per iteration although nothing is kept (``benchmarks/flat_memory.py``: 1.3-2.9 KiB per
iteration on gpt-tiny, nearly all of it returned by ``malloc_trim``). At an iteration boundary, at most once every
``every_s`` seconds, ``Trimmer.maybe`` asks glibc to return what is free. Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

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


class Trimmer:
    """Calls glibc's ``malloc_trim(0)`` at most once every ``every_s`` seconds (0 or less: never)."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self.trim = _malloc_trim() if every_s > 0 else None
        self.last = clock()
        self.count = 0

    def maybe(self) -> bool:
        """Trim if it is time; True when it did."""
        if self.trim is None or self.clock() - self.last < self.every_s:
            return False
        self.trim(0)
        self.last = self.clock()
        self.count += 1
        return True
