"""The Restarter's refusals (the restarts themselves are tests/integration/test_restarts.py)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vpipe_lab.control.errors import WorkerError
from vpipe_lab.control.state import JobState
from vpipe_lab.control.workers.restarts import NotBack, Restart, Restarter
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.settings import Settings
from vpipe_lab.wire import snapshot_format
from vpipe_lab.wire.jobspec import JobSpec
from vpipe_lab.wire.snapshot_format import SnapshotMeta


class Launcher:
    def __init__(self) -> None:
        self.ended = 0

    def end_workers(self, timeout: float) -> None:
        self.ended += 1


def restarter(tmp_path: Path, limit: int) -> tuple[Restarter, Launcher]:
    spec = JobSpec("s", "k", "tcp://x:1", "127.0.0.1", 1, Settings(stages=2, microbatches=2), snapshot_dir=str(tmp_path))
    launcher = Launcher()
    host = SimpleNamespace(forget_partial=lambda stages=None: None, restarted=lambda restart: None,
                           layer_times=lambda: None)
    r = Restarter(limit, spec, tmp_path, launcher, JobState(), None, threading.Condition(), 5.0,  # type: ignore[arg-type]
                  host)  # type: ignore[arg-type]
    return r, launcher


def test_with_no_restart_left_the_failure_ends_the_job(tmp_path: Path) -> None:
    r, launcher = restarter(tmp_path, 0)
    error = WorkerError(1, "killed")
    assert r.recover(error) is error and launcher.ended == 0


def test_a_job_whose_model_was_replaced_is_not_restarted(tmp_path: Path) -> None:
    r, launcher = restarter(tmp_path, 3)
    where = snapshot_format.directory(tmp_path, (4, 1, 1))
    where.mkdir(parents=True)
    SnapshotMeta(4, {}, 1, 1).write(where)
    for stage in range(2):
        snapshot_format.mark_done(tmp_path, (4, 1, 1), stage)
    error = WorkerError(0, "killed")
    assert r.recover(error) is error and launcher.ended == 0  # set_model's factory is not what a new worker builds


def test_a_replayed_loss_is_compared_with_the_first() -> None:
    r, _ = restarter(Path("/nonexistent"), 1)
    r.replayed(3, 1.0, 1.0)  # before any restart: nothing to note
    r.done.append(Restart(1, 0.0, 1, "killed", 2, 3, 0.1))
    r.replayed(2, 1.5, 1.5)
    r.replayed(3, 2.0, 2.25)
    assert r.done[0].loss_diff == 0.25 and r.done[0].to_dict()["replayed"] == 3


def test_without_a_stage_the_spec_has_one_stage_fewer_and_skips_its_budget_and_device(tmp_path: Path) -> None:
    r, _ = restarter(tmp_path, 1)
    plan = Plan.from_counts([2, 2, 2], 3, policy="swap")
    spec = replace(r.spec, settings=replace(r.spec.settings, stages=3, memory_budget=(10, 20, 30)), plan=plan.to_dict())
    fewer, note = r._without(spec, NotBack(1, "its replacement died as it started (exit code 17)"))
    assert fewer.settings.stages == 2 and fewer.settings.memory_budget == (10, 30) and fewer.devices == [0, 2]
    assert Plan.from_dict(fewer.plan).boundaries == (0, 3, 6) and Plan.from_dict(fewer.plan).policies == plan.policies
    assert note.startswith("stage 1 could not come back: its replacement died as it started (exit code 17); going "
                           "on with 1f1b on 2 stages, equal layer counts")
    assert r.spec.settings.stages == 2  # the session's own spec changes only once the fewer stages are running
    again, _ = r._without(replace(fewer, plan=Plan.from_dict(fewer.plan).to_dict()), NotBack(0, "gone"))
    assert again.devices == [2]  # the second loss skips the first lost device too


@pytest.mark.parametrize(("changes", "match"), [
    ({"replicas": 2}, "a job of 2 pipeline replicas x 1 shards is not re-planned onto fewer stages"),
    ({"shards": 2}, "a job of 1 pipeline replicas x 2 shards is not re-planned onto fewer stages"),
    ({"stages": 1}, "one stage has no stage to fall back on"),
])
def test_a_job_that_cannot_go_on_with_fewer_stages_says_why(tmp_path: Path, changes: dict[str, Any],
                                                          match: str) -> None:
    r, _ = restarter(tmp_path, 1)
    plan = Plan.from_counts([4] if changes.get("stages") == 1 else [2, 2], 2)
    spec = replace(r.spec, settings=replace(r.spec.settings, **changes), plan=plan.to_dict())
    with pytest.raises((RuntimeError, PlanError), match=match):
        r._without(spec, NotBack(0, "gone"))
