"""Restarts (``launch(max_restarts=N)``): a dead or hung stage is replaced and training ends equal to an undisturbed run."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import vpipe_lab
from tests.conftest import worker_processes
from vpipe_lab.control.errors import WorkerError
from vpipe_lab.examples import mlp

pytestmark = pytest.mark.slow
ITERATIONS = 30  # enough for a snapshot, a fault between two, and iterations after the replay
AT = 12  # the fault comes once this many iterations are done
SNAPSHOT = 5  # iterations between snapshots


def launch(**kw: Any) -> vpipe_lab.Session:
    return vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu", **{"timeout": 30, **kw})


def train(session: vpipe_lab.Session, iterations: int = ITERATIONS, fault: Any = None, at: int = AT,
          ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train ``iterations``; ``fault(session)`` once ``at`` of them are done. The state and every recorded loss."""
    session.run(iterations)
    if fault is not None:
        session.wait(at, timeout=60)
        fault(session)
    session.wait(timeout=120)
    frame = session.metrics.iterations
    assert list(frame["iteration"]) == list(range(session.iteration))  # each iteration recorded once, none missing
    return session.state_dict(), list(frame["loss"])


@pytest.fixture(scope="module")
def undisturbed() -> tuple[dict[str, torch.Tensor], list[float]]:
    with launch() as s:
        return train(s)


def assert_equal(got: tuple[dict[str, torch.Tensor], list[float]],
                 expected: tuple[dict[str, torch.Tensor], list[float]]) -> None:
    state, losses = got
    assert losses == expected[1]  # exactly: the replay is the same arithmetic on the same batches
    assert state.keys() == expected[0].keys()
    for key, value in expected[0].items():
        assert torch.equal(state[key], value), key


def kill(rank: int) -> Any:
    def fault(session: vpipe_lab.Session) -> None:
        os.kill(session.processes.pids()[rank], signal.SIGKILL)
    return fault


@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_stage_is_replaced_and_training_ends_equal(rank: int, undisturbed: Any) -> None:
    with launch(max_restarts=2, snapshot_every=SNAPSHOT) as s:
        first = s.processes.pids()
        got = train(s, fault=kill(rank))
        restarts = s.metrics.restarts
        assert s.status == "idle" and s.failure is None
        assert set(s.processes.pids().values()).isdisjoint(first.values())  # every worker is a replacement
    assert_equal(got, undisturbed)
    assert len(restarts) == 1
    row = restarts.iloc[0]
    assert row["stage"] == rank and "signal 9" in row["cause"]
    # snapshots every SNAPSHOT iterations: it went back to the newest one before the kill and replayed what followed
    assert row["snapshot"] % SNAPSHOT == 0 and 0 < row["replayed"] <= SNAPSHOT + 2
    assert row["loss_diff"] == 0.0  # the replayed iterations gave the losses the first run recorded
    assert worker_processes() == []


def test_a_hung_stage_is_replaced(undisturbed: Any) -> None:
    """SIGSTOP: the stage is alive and silent; its neighbour gives up after ``timeout`` and the job restarts."""
    with launch(max_restarts=1, snapshot_every=SNAPSHOT, timeout=4) as s:
        stopped: list[int] = []

        def hang(session: vpipe_lab.Session) -> None:
            stopped.append(session.processes.pids()[1])
            os.kill(stopped[0], signal.SIGSTOP)

        got = train(s, fault=hang)
        row = s.metrics.restarts.iloc[0]
    assert_equal(got, undisturbed)
    assert row["stage"] == 1 and "stopped responding" in row["cause"]
    assert worker_processes() == []


def test_after_max_restarts_a_failure_ends_the_job() -> None:
    with launch(max_restarts=1, snapshot_every=SNAPSHOT) as s:
        s.run(10**6)
        s.wait(AT, timeout=60)
        os.kill(s.processes.pids()[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not s.processes.restarts and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(s.processes.restarts) == 1
        s.wait(s.iteration + 5, timeout=60)  # training goes on after the restart
        os.kill(s.processes.pids()[0], signal.SIGKILL)
        with pytest.raises(WorkerError) as err:
            s.wait(10**6, timeout=60)
        assert err.value.stage == 0 and "signal 9" in str(err.value)
        assert s.status == "failed"
    assert worker_processes() == []


class Stream:
    """An iterable whose batches differ every time it is iterated (a stream, or random augmentation): only the
    batches buffered since the snapshot can replay the lost iterations as they ran."""

    def __init__(self, length: int) -> None:
        self.length, self.epoch = length, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.epoch += 1
        gen = torch.Generator().manual_seed(1000 * self.epoch + os.getpid())
        for _ in range(self.length):
            yield torch.randn(8, mlp.WIDTHS[0], generator=gen), torch.randn(8, mlp.WIDTHS[-1], generator=gen)


def test_batches_of_an_iterable_are_replayed_from_the_buffer() -> None:
    """Rank 0 (the data reader) dies: the replacement replays the buffered batches, so the replayed losses equal
    the recorded ones although a new iterator would give other batches."""
    with launch(data=Stream(10**6), max_restarts=1, snapshot_every=SNAPSHOT) as s:
        s.run(ITERATIONS)
        s.wait(AT, timeout=60)
        os.kill(s.processes.pids()[0], signal.SIGKILL)
        s.wait(timeout=120)
        row = s.metrics.restarts.iloc[0]
        losses = list(s.metrics.iterations["loss"])
    assert row["replayed"] > 0 and row["loss_diff"] == 0.0
    assert len(losses) == ITERATIONS


def test_a_live_change_survives_a_restart(undisturbed: Any) -> None:
    """The plan in force is snapshotted when it changes, so the restart runs it, not the plan the job began with."""
    with launch(max_restarts=1, snapshot_every=1000) as s:
        s.run(10)
        s.wait(timeout=60)
        s.set_partition((0, 3, 10))
        got = train(s, ITERATIONS - 10, fault=kill(1), at=AT + 4)
        assert s.iteration == ITERATIONS
        assert s.plan.boundaries == (0, 3, 10) and s.processes.layers() == [[0, 1, 2], list(range(3, 10))]
        row = s.metrics.restarts.iloc[0]
    assert row["snapshot"] == 10  # the snapshot taken as the change came into force
    state, losses = got
    assert losses == pytest.approx(undisturbed[1], abs=1e-6)
    for key, value in undisturbed[0].items():
        assert torch.allclose(state[key], value, atol=1e-6), key


def test_a_stage_that_cannot_come_back_is_planned_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 1 of 3 is killed and its replacement dies as it starts (its device is gone): the job goes on with two
    stages holding all ten layers, read from the snapshot the three took, and ends equal to a three-stage run."""
    with vpipe_lab.launch("mlp", stages=3, microbatches=3, device="cpu", timeout=30) as s:
        expected = train(s)
    with vpipe_lab.launch("mlp", stages=3, microbatches=3, device="cpu", timeout=30, max_restarts=2,
                          snapshot_every=SNAPSHOT) as s:

        def lose_stage_1(session: vpipe_lab.Session) -> None:
            monkeypatch.setenv("VPIPE_LAB_FAULT", "start:1:exit@1")  # a worker started from now on on device 1 dies
            os.kill(session.processes.pids()[1], signal.SIGKILL)

        state, losses = train(s, fault=lose_stage_1)
        monkeypatch.delenv("VPIPE_LAB_FAULT")
        row = s.metrics.restarts.iloc[0]
        assert s.plan.stages == 2 and len(s.processes.pids()) == 2 and s.status == "idle"
        assert s._spec.devices == [0, 2]  # on a GPU machine the new rank 1 takes the third GPU, not the lost one
        assert sorted(i for layers in s.processes.layers() for i in layers) == list(range(10))
        s.set_partition((0, 4, 10))  # the session is a two-stage session now: live changes work on it
        s.run(2)
        s.wait(timeout=60)
        assert s.processes.layers() == [[0, 1, 2, 3], list(range(4, 10))]
    assert len(losses) == ITERATIONS and row["stages"] == 2 and len(s.processes.restarts) == 1
    assert "stage 1 could not come back: its replacement died as it started (exit code 17)" in row["note"]
    assert "1f1b on 2 stages, balanced by the measured layer times" in row["note"]
    assert losses == pytest.approx(expected[1], abs=1e-6)
    for key, value in expected[0].items():
        assert torch.allclose(state[key], value, atol=1e-6), key
    assert worker_processes() == []


def test_a_single_stage_that_cannot_come_back_ends_the_job_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    with vpipe_lab.launch("mlp", stages=1, microbatches=2, device="cpu", timeout=30, max_restarts=2,
                          snapshot_every=5) as s:
        s.run(10**6)
        s.wait(10, timeout=60)
        monkeypatch.setenv("VPIPE_LAB_FAULT", "start:0:exit@1")  # device 0 is gone
        os.kill(s.processes.pids()[0], signal.SIGKILL)
        with pytest.raises(WorkerError) as err:
            s.wait(10**6, timeout=120)
        monkeypatch.delenv("VPIPE_LAB_FAULT")
    text = str(err.value)
    assert "signal 9" in text and "it was not restarted" in text and "no stage to fall back on" in text
    assert worker_processes() == []
