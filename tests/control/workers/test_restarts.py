"""The Restarter's refusals (the restarts themselves are tests/integration/test_restarts.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from vpipe_lab.control.errors import WorkerError
from vpipe_lab.control.state import JobState
from vpipe_lab.control.workers.restarts import Restart, Restarter
from vpipe_lab.wire import snapshot
from vpipe_lab.wire.jobspec import JobSpec
from vpipe_lab.wire.snapshot import SnapshotMeta


class Launcher:
    def __init__(self) -> None:
        self.ended = 0

    def end_workers(self, timeout: float) -> None:
        self.ended += 1


def restarter(tmp_path: Path, limit: int) -> tuple[Restarter, Launcher]:
    spec = JobSpec("s", "k", "tcp://x:1", "127.0.0.1", 1, 2, 2, snapshot_dir=str(tmp_path))
    launcher = Launcher()
    done: list[Any] = []
    r = Restarter(limit, spec, tmp_path, launcher, JobState(), None, threading.Condition(), 5.0,  # type: ignore[arg-type]
                  lambda: None, done.append)
    return r, launcher


def test_with_no_restart_left_the_failure_ends_the_job(tmp_path: Path) -> None:
    r, launcher = restarter(tmp_path, 0)
    error = WorkerError(1, "killed")
    assert r.recover(error) is error and launcher.ended == 0


def test_a_job_whose_model_was_replaced_is_not_restarted(tmp_path: Path) -> None:
    r, launcher = restarter(tmp_path, 3)
    where = snapshot.directory(tmp_path, (4, 1, 1))
    where.mkdir(parents=True)
    SnapshotMeta(4, {}, 1, 1).write(where)
    for stage in range(2):
        snapshot.mark_done(tmp_path, (4, 1, 1), stage)
    error = WorkerError(0, "killed")
    assert r.recover(error) is error and launcher.ended == 0  # set_model's factory is not what a new worker builds


def test_a_replayed_loss_is_compared_with_the_first() -> None:
    r, _ = restarter(Path("/nonexistent"), 1)
    r.replayed(3, 1.0, 1.0)  # before any restart: nothing to note
    r.done.append(Restart(1, 0.0, 1, "killed", 2, 3, 0.1))
    r.replayed(2, 1.5, 1.5)
    r.replayed(3, 2.0, 2.25)
    assert r.done[0].loss_diff == 0.25 and r.done[0].to_dict()["replayed"] == 3
