"""Freed memory goes back to the system at iteration boundaries, at most once per interval."""

from __future__ import annotations

import platform

import pytest

from vpipe_lab.runtime.heap import Trimmer


def test_trims_at_most_once_per_interval() -> None:
    now = [0.0]
    trimmer = Trimmer(10.0, clock=lambda: now[0])
    calls: list[int] = []
    trimmer.trim = lambda pad: calls.append(pad) or 1  # count the calls; the real one is below
    assert not trimmer.maybe()
    now[0] = 9.9
    assert not trimmer.maybe()
    now[0] = 10.0
    assert trimmer.maybe() and calls == [0]
    now[0] = 15.0
    assert not trimmer.maybe() and trimmer.count == 1
    assert Trimmer(0).trim is None and not Trimmer(0).maybe()  # 0 turns it off


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_glibc_returns_freed_memory() -> None:
    """The real malloc_trim: freeing many small blocks leaves resident memory that a trim gives back."""
    import psutil

    trimmer = Trimmer(1.0, clock=lambda: 100.0)
    trimmer.last = 0.0
    assert trimmer.trim is not None
    me = psutil.Process()
    blocks = [bytearray(2000) for _ in range(50_000)]  # ~100 MB of blocks from glibc (over pymalloc's 512 B)
    keep = blocks[::1000]  # a few survivors pin the heap's top, as long-lived objects do
    del blocks
    before = me.memory_info().rss
    assert trimmer.maybe()
    after = me.memory_info().rss
    assert after < before - 20 * 2**20, (before, after)
    assert len(keep) == 50
