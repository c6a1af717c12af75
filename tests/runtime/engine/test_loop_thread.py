"""gloo's loop thread found by name in a real two-rank group, and kept at idle priority only inside the window."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from tests.runtime.engine.test_comm import _join, two_ranks
from vpipe_lab.runtime.engine import loop_thread
from vpipe_lab.runtime.engine.comm import TAG_FORWARD
from vpipe_lab.runtime.engine.loop_thread import QuietLoop, idle_round_trip_allowed, loop_threads


def _gloo_rank(rank: int, port: int, out: dict) -> None:  # type: ignore[type-arg]
    peer = _join(rank, port)
    if rank == 0:
        peer.send(torch.ones(4), 1, TAG_FORWARD)
        peer.flush()
    else:
        peer.recv(0, TAG_FORWARD)
    tids = loop_threads()
    quiet = QuietLoop()
    before = [os.sched_getscheduler(tid) for tid in tids]
    with quiet:
        inside = [os.sched_getscheduler(tid) for tid in tids]
    after = [os.sched_getscheduler(tid) for tid in tids]
    out[rank] = (len(tids), before, inside, after, idle_round_trip_allowed(), len(quiet.threads))
    dist.destroy_process_group()


def test_gloo_loop_threads_are_found_and_quiet_only_inside_the_window() -> None:
    out = two_ranks(_gloo_rank)
    for rank in (0, 1):
        found, before, inside, after, allowed, kept = out[rank]
        assert found >= 1, "torch's gloo no longer names its TCP loop thread gloo_tcp_loop: update loop_thread.NAME"
        assert after == before
        if allowed:
            assert kept == found and inside == [os.SCHED_IDLE] * found
        else:  # without the round trip nothing is touched
            assert kept == 0 and inside == before


@pytest.fixture
def helper() -> Iterator[int]:
    """A sleeping thread of this process, standing in for gloo's loop thread."""
    stop = threading.Event()
    ready: list[int] = []

    def body() -> None:
        ready.append(threading.get_native_id())
        stop.wait(30)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    while not ready:
        threading.Event().wait(0.01)
    yield ready[0]
    stop.set()
    t.join(timeout=5)


def test_the_thread_goes_back_to_its_own_policy(helper: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if not idle_round_trip_allowed():
        pytest.skip("this process may not take a thread back out of SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE 0)")
    os.sched_setscheduler(helper, os.SCHED_BATCH, os.sched_param(0))
    monkeypatch.setattr(loop_thread, "loop_threads", lambda: [helper])
    quiet = QuietLoop()
    with quiet:
        assert os.sched_getscheduler(helper) == os.SCHED_IDLE
    assert os.sched_getscheduler(helper) == os.SCHED_BATCH


def test_nothing_is_touched_without_the_round_trip(helper: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop_thread, "idle_round_trip_allowed", lambda: False)
    monkeypatch.setattr(loop_thread, "loop_threads", lambda: [helper])
    before = os.sched_getscheduler(helper)
    quiet = QuietLoop()
    with quiet:
        assert os.sched_getscheduler(helper) == before
    assert quiet.threads == []


def test_an_exception_inside_still_restores(helper: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if not idle_round_trip_allowed():
        pytest.skip("this process may not take a thread back out of SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE 0)")
    monkeypatch.setattr(loop_thread, "loop_threads", lambda: [helper])
    before = os.sched_getscheduler(helper)
    with pytest.raises(RuntimeError, match="gloo failed"), QuietLoop():
        raise RuntimeError("gloo failed")
    assert os.sched_getscheduler(helper) == before
