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


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_census_sees_memory_kept_apart_from_memory_freed() -> None:
    """What malloc has handed out grows by what is kept and falls back when it is freed; RSS is reported beside it."""
    from vpipe_lab.runtime.heap import census

    before = census()
    assert before["rss"] > 0 and before["malloc_used"] > 0 and before["threads"] >= 1 and before["py_objects"] > 0
    kept = [bytearray(4000) for _ in range(10_000)]  # ~40 MB from malloc, not mmapped one by one
    during = census()
    assert during["malloc_used"] - before["malloc_used"] > 35 * 2**20, (before, during)
    del kept
    after = census()
    assert after["malloc_used"] - before["malloc_used"] < 5 * 2**20, (before, after)
    assert after["traced"] == -1  # tracemalloc is off unless asked for


class Kept:
    """An object a leak would keep."""


# Run in a fresh interpreter: a census counts every object of its process, and the test runner's own (hundreds of
# thousands after the files before it) made this test cost 6-17 s, depending on what ran first.
CENSUS_SCRIPT = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s|%(message)s")
from vpipe_lab.runtime.heap import Trimmer

class Kept:
    pass

now = [100.0]
os.environ["VPIPE_LAB_HEAP_LOG"] = "30"
trimmer = Trimmer(10.0, clock=lambda: now[0])
trimmer.trim = lambda pad: 1
assert trimmer.census_s == 30.0
kept = []
for t, it in ((110.0, 5), (120.0, 9), (140.0, 17)):
    now[0] = t
    assert trimmer.maybe(it)
    kept += [Kept() for _ in range(500)]  # what a leak looks like: objects of one type, more each time
os.environ["VPIPE_LAB_HEAP_LOG"] = "soon"
assert Trimmer(10.0).census_s == 0.0  # not a number: a warning, no census
del os.environ["VPIPE_LAB_HEAP_LOG"]
assert Trimmer(10.0).census_s == 0.0
"""


def test_census_is_logged_only_when_asked_and_at_most_once_per_interval() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CENSUS_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    records = [line.split("|", 1) for line in out.stdout.splitlines() if "|" in line]
    messages = [m for name, m in records if name == "vpipe_lab.runtime.heap"]
    lines = [m for m in messages if "heap census: iteration" in m]
    assert len(lines) == 2 and lines[0].startswith("heap census: iteration=5 garbage=") and "iteration=17" in lines[1]
    assert " collect_us=" in lines[0]  # what the minute's full collection cost, beside what it leaves
    assert " rss=" in lines[0] and " malloc_used=" in lines[0] and " py_objects=" in lines[0]
    grown = [m for m in messages if "objects grown by type" in m]
    assert len(grown) == 1 and "Kept +1000" in grown[0], grown  # 500 after census 1 and 500 after the dropped one
    assert any("'soon' is not a number of seconds" in m for m in messages)


def test_collecting_garbage_counts_the_cycles_by_type_and_frees_them() -> None:
    import gc
    import weakref

    from vpipe_lab.runtime.heap import collect_garbage

    gc.collect()
    first, second = Kept(), Kept()
    first.other, second.other = second, first  # type: ignore[attr-defined]  # a reference cycle
    gone = weakref.ref(first)

    def make() -> None:
        def again() -> object:  # a closure that refers to itself: a function and its cell, a cycle once make returns
            return again

    make()
    del first, second
    found, kinds = collect_garbage()
    assert found >= 2 and kinds["Kept"] == 2 and gone() is None  # counted, then freed
    named = f"function {__name__}.test_collecting_garbage_counts_the_cycles_by_type_and_frees_them.<locals>.make"
    named += ".<locals>.again"
    assert kinds[named] == 1 and kinds["cell"] >= 1  # a function is named by where it was defined
    assert gc.garbage == [] and not gc.get_debug() & gc.DEBUG_SAVEALL


def test_a_full_collection_runs_before_a_trim_at_most_once_per_interval() -> None:
    """The few cycles an iteration leaves are freed within a minute, not when Python's own full collection comes."""
    import gc
    import weakref

    now = [0.0]
    trimmer = Trimmer(10.0, clock=lambda: now[0], census_s=0, collect_s=60.0)
    trimmer.trim = lambda pad: 1
    gc.disable()  # only the trimmer collects here
    try:
        first, second = Kept(), Kept()
        first.other, second.other = second, first  # type: ignore[attr-defined]  # a cycle, as tree_flatten leaves
        gone = weakref.ref(first)
        del first, second
        now[0] = 30.0
        assert trimmer.maybe() and trimmer.collections == 0 and gone() is not None  # trimmed, not collected yet
        now[0] = 60.0
        assert trimmer.maybe() and trimmer.collections == 1 and gone() is None and trimmer.collect_cost_s > 0
        now[0] = 100.0
        assert trimmer.maybe() and trimmer.collections == 1  # the next one a minute after
    finally:
        gc.enable()
    assert Trimmer(10.0, collect_s=0).collect_s == 0  # 0 turns it off


def test_an_object_whose_getattr_raises_is_counted_by_its_type() -> None:
    """A census of the garbage met an attribute dict whose __getattr__ raises KeyError: it failed the census."""
    from vpipe_lab.runtime.heap import _kind

    class AttrDict(dict):  # type: ignore[type-arg]
        def __getattr__(self, name: str) -> object:
            return self[name]

    assert _kind(AttrDict()) == "test_an_object_whose_getattr_raises_is_counted_by_its_type.<locals>.AttrDict"
