"""The failure monitor: which stage's report is the root cause, and what it says about the way back."""

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vpipe_lab.control.errors import BudgetError, DataError
from vpipe_lab.control.state import JobState
from vpipe_lab.control.subscriptions import Events
from vpipe_lab.control.workers.monitor import FailureMonitor
from vpipe_lab.wire.events import Failure


class Launcher:
    """Worker processes as the monitor sees them: rank, exit code, log tail."""

    def __init__(self, codes: dict[int, int | None]) -> None:
        self.workers = [SimpleNamespace(rank=r, popen=SimpleNamespace(poll=lambda c=c: c), tail=lambda r=r: f"log {r}")
                        for r, c in codes.items()]
        self.terminated, self.kept = False, None

    def exited(self) -> list[tuple[Any, int]]:
        return [(w, w.popen.poll()) for w in self.workers if w.popen.poll() is not None]

    def alive(self) -> list[Any]:
        return [] if self.terminated else [w for w in self.workers if w.popen.poll() is None]

    def terminate(self, timeout: float, keep: str | None = None) -> None:
        self.terminated, self.kept = True, keep


def monitor(codes: dict[int, int | None], job_dir: Path | None = None) -> tuple[FailureMonitor, JobState, Events]:
    state, events = JobState(), Events()
    return FailureMonitor(Launcher(codes), job_dir, state, events, threading.Condition()), state, events  # type: ignore[arg-type]


def test_a_stages_own_exception_beats_the_broken_connections_it_caused() -> None:
    mon, _, _ = monitor({0: 1, 1: 1})
    mon.on_error(Failure("exception", 0, cause="CommError: stage 1 went away"))
    mon.on_error(Failure("exception", 1, cause="RuntimeError: shapes do not match", traceback="tb"))
    err = mon.root_cause()
    assert err.stage == 1 and "shapes do not match" in err.cause and err.log_tail == "log 1"


def test_a_killed_stage_is_named_with_its_signal() -> None:
    mon, _, _ = monitor({0: None, 1: -9})
    mon.on_error(Failure("exception", 0, cause="Connection reset by peer"))
    err = mon.root_cause()
    assert err.stage == 1 and "SIGKILL" in err.cause and err.exit_code == -9


def test_a_silent_live_stage_is_reported_as_stuck() -> None:
    mon, _, _ = monitor({0: None, 1: None})
    mon.on_error(Failure("exception", 0, cause="CommError: timed out waiting for stage 1"))
    err = mon.root_cause()
    assert err.stage == 1 and "stopped responding" in err.cause


def test_refusals_and_budgets_are_filed_not_fatal(tmp_path: Path) -> None:
    mon, state, _ = monitor({0: None})
    mon.on_error(Failure("migration", 1, version=3, needed=10, budget=5))
    mon.on_error(Failure("budget", 0, used=9, budget=8, layers=[[0, 9]], iteration=4))
    assert mon.refusals[3].needed == 10 and isinstance(mon.budget, BudgetError)
    mon.on_error(Failure("exception", 0, cause="RuntimeError: x"))
    state.migrating = 2  # a failure during a migration points at the checkpoint taken before it, when complete
    (tmp_path / "checkpoints" / "plan-v2").mkdir(parents=True)
    mon.job_dir = tmp_path
    assert mon.root_cause().checkpoint is None
    (tmp_path / "checkpoints" / "plan-v2" / "latest").write_text("v")
    assert mon.root_cause().checkpoint == str(tmp_path / "checkpoints" / "plan-v2")


def test_the_watch_thread_declares_the_failure_stops_the_rest_and_says_so() -> None:
    mon, _, events = monitor({0: None, 1: 3})
    seen: list[dict[str, Any]] = []
    events.subscribe(seen.append)
    mon.start()
    try:
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        mon.close()
    assert mon.fatal is not None and mon.fatal.stage == 1 and "exited with code 3" in mon.fatal.cause
    assert seen and seen[0]["type"] == "failed" and seen[0]["stage"] == 1


def test_the_root_cause_says_where_it_happened() -> None:
    mon, _, _ = monitor({0: 1, 1: 1})
    mon.on_error(Failure("exception", 1, iteration=3, cause="RuntimeError: boom", microbatch=2,
                         action="backward in unit 4 (h.2)"))
    err = mon.root_cause()
    assert (err.iteration, err.microbatch, err.action) == (3, 2, "backward in unit 4 (h.2)")
    assert str(err).startswith("stage 1 failed at iteration 3, micro-batch 2 (backward in unit 4 (h.2)): RuntimeError")
    killed, _, _ = monitor({0: None, 1: -9})
    killed.state.iteration, killed.state.target = 5, 10
    assert str(killed.root_cause()).startswith("stage 1 failed at iteration 5: the worker process was killed")
    killed.state.paused = True  # killed while paused: no iteration ran
    assert str(killed.root_cause()).startswith("stage 1 failed: the worker process was killed")


def test_a_bad_batch_pauses_and_is_raised_once() -> None:
    mon, state, _ = monitor({0: None})
    mon.on_error(Failure("data", 0, iteration=3, cause="inputs['input_ids'] is float32"))
    assert state.paused and not mon._reports
    err = mon.take_budget()
    assert isinstance(err, DataError) and err.iteration == 3 and mon.take_budget() is None
    assert str(err).startswith("the batch of iteration 3 is bad data: inputs['input_ids'] is float32. Training is "
                               "paused")


def test_with_restarts_a_failure_is_recovered_instead_of_raised() -> None:
    from vpipe_lab.control.errors import WorkerError

    mon, _, events = monitor({0: None, 1: -9})
    seen: list[dict[str, Any]] = []
    events.subscribe(seen.append)
    asked: list[WorkerError] = []
    mon.recover = lambda err: asked.append(err)  # type: ignore[func-returns-value]  # None: training goes on
    mon._failed(mon.root_cause())
    assert mon.fatal is None and asked[0].stage == 1 and not mon.recovering
    assert seen[0]["type"] == "restarting" and seen[0]["stage"] == 1
    mon.recover = lambda err: err  # no restart left: the error ends the job
    mon._failed(mon.root_cause())
    assert mon.fatal is not None and mon.fatal.stage == 1
