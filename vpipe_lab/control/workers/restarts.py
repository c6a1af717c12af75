"""Restarting a failed pipeline by itself (``launch(max_restarts=N)``, torchrun's word and meaning).

When a worker dies (killed, a segfault, out of memory), raises, or hangs (its neighbours give up waiting for it after
the job's ``timeout``), the failure monitor names the root cause as before; with restarts left, the Restarter then
replaces every worker (the survivors' process group is broken with the dead one: torch.distributed cannot take a new
member into a gloo group), starts them from the newest complete snapshot (``wire/snapshot.py``, written by the
workers every few iterations) and asks them to train to the target the session had. The lost iterations run again
on the same batches (``data(i)``, or the batches rank 0 buffered from an iterable) with the same seeds, so the
parameters end equal to an undisturbed run; the session records each iteration once and checks the replayed
losses against the ones it recorded the first time. After ``max_restarts`` restarts a failure ends the job, as
without them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from vpipe_lab.control.errors import WorkerError
from vpipe_lab.control.requests import Requests
from vpipe_lab.control.state import JobState
from vpipe_lab.control.workers.processes import Launcher
from vpipe_lab.core.plan import Plan
from vpipe_lab.wire import snapshot
from vpipe_lab.wire.commands import Run
from vpipe_lab.wire.jobspec import JobSpec

log = logging.getLogger(__name__)


@dataclass
class Restart:
    """One restart, as ``session.restarts`` and the dashboard show it."""

    number: int  # 1 for the first
    time: float  # when the failure was named (seconds since the epoch)
    stage: int  # the stage that failed
    cause: str
    snapshot: int  # the iteration the pipeline went back to
    replayed: int  # iterations that had completed and ran again
    seconds: float  # from the failure being named to training again
    loss_diff: float | None = None  # the largest difference of a replayed iteration's loss from the first run's

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Restarter:
    """Owns the restarts of one launched session (the failure monitor's thread calls ``recover``)."""

    def __init__(self, limit: int, spec: JobSpec, job_dir: Path, launcher: Launcher, state: JobState,
                 requests: Requests, cond: threading.Condition, start_timeout: float,
                 forget_partial: Callable[[], None], restarted: Callable[[Restart], None]) -> None:
        self.limit, self.spec, self.job_dir, self.launcher = limit, spec, job_dir, launcher
        self.state, self.requests, self.cond, self.start_timeout = state, requests, cond, start_timeout
        self.forget_partial, self.restarted = forget_partial, restarted
        self.done: list[Restart] = []

    @property
    def root(self) -> Path:
        assert self.spec.snapshot_dir is not None
        return Path(self.spec.snapshot_dir)

    def replayed(self, iteration: int, loss: float | None, recorded: float | None) -> None:
        """An iteration recorded before the restart ran again: note how far its loss is from the first run's."""
        if not self.done or loss is None or recorded is None:
            return
        last = self.done[-1]
        diff = abs(float(loss) - float(recorded))
        last.loss_diff = diff if last.loss_diff is None else max(last.loss_diff, diff)

    def recover(self, error: WorkerError) -> WorkerError | None:
        """Restart the pipeline from the newest complete snapshot: None when training goes on, else the error that
        ends the job (``error``, saying why it was not restarted where that is news)."""
        if len(self.done) >= self.limit:
            if self.limit:
                log.error("no restart left (max_restarts=%d): the job ends", self.limit)
            return error
        found = snapshot.newest(self.root, self.spec.stages)
        if found is not None and found[1].model_version != 0:
            log.error("not restarting: the model was changed with set_model, which a restarted worker cannot rebuild")
            return error
        began = time.monotonic()
        log.warning("%s; restarting every worker from %s", str(error).splitlines()[0],
                    f"the snapshot of iteration {found[1].iteration}" if found else "the start")
        self.launcher.end_workers(timeout=2.0)
        spec = self.spec
        if found is not None:
            where, meta = found
            spec = replace(spec, start_iteration=meta.iteration, plan=meta.plan, restore_snapshot=str(where),
                           resume_path=None, scout=False)
        else:
            spec = replace(spec, scout=False)
        number = len(self.done) + 1
        path = self.job_dir / f"job-restart-{number}.json"
        spec.save(path)
        with self.cond:
            self.state.ready.clear()
            self.forget_partial()
            self.requests.replaced(f"iteration {spec.start_iteration}, plan version "
                                  f"{found[1].plan_version if found else 0}")
        try:
            self._start(path)
        except Exception as exc:  # the replacement could not start: the job ends with the first failure's cause
            log.error("the restart failed: %s", exc)
            self.launcher.end_workers(timeout=2.0)
            return error
        start = spec.start_iteration
        restart = Restart(number, time.time(), error.stage, error.cause.splitlines()[0] if error.cause else "", start,
                          max(0, self.state.iteration - start), time.monotonic() - began)
        self.done.append(restart)
        with self.cond:
            if found is not None:
                self.state.plan, self.state.plan_version = Plan.from_dict(found[1].plan), found[1].plan_version
        self._resume_training(start)
        restart.seconds = time.monotonic() - began
        self.restarted(restart)
        log.warning("restart %d of %d: stage %d replaced, back at iteration %d, %d iteration(s) to replay, %.1f s",
                    number, self.limit, restart.stage, start, restart.replayed, restart.seconds)
        return None

    def _start(self, spec_path: Path) -> None:
        """Spawn every rank on ``spec_path`` and wait until each is ready (raises if one fails or is late)."""
        workers = self.spec.stages * self.spec.replicas
        for rank in range(workers):
            self.launcher.start_rank(rank, spec_path)

        def ready() -> bool:
            if any(rc != 0 for _, rc in self.launcher.exited()):
                raise RuntimeError("a replacement worker exited while starting")
            return len(self.state.ready) >= workers

        self.requests.until(ready, self.start_timeout, "the replacement workers did not start")

    def _resume_training(self, start: int) -> None:
        """Ask the new workers for what the session had asked of the old ones: its target (paused: only the
        iterations already run, so the replay completes and the session shows no gap)."""
        target, paused = self.state.target, self.state.paused
        if paused:
            goal: int | None = self.state.iteration
            with self.cond:
                self.state.target, self.state.paused = goal, False
        else:
            goal = target
        if goal is None or goal > start:
            self.requests.command(Run(iterations=None if goal is None else goal - start))
