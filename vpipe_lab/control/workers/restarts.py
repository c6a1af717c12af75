"""Restarting a failed pipeline by itself (``launch(max_restarts=N)``, torchrun's word and meaning).

When a worker dies (killed, a segfault, out of memory), raises, or hangs (its neighbours give up waiting for it after
the job's ``timeout``), the failure monitor names the root cause as before; with restarts left, the Restarter then
replaces every worker (the survivors' process group is broken with the dead one: torch.distributed cannot take a new
member into a gloo group), starts them from the newest complete snapshot (``wire/snapshot_format.py``, written by the
workers every few iterations) and asks them to train to the target the session had. The lost iterations run again
on the same batches (``data(i)``, or the batches rank 0 buffered from an iterable) with the same seeds, so the
parameters end equal to an undisturbed run; the session records each iteration once and checks the replayed
losses against the ones it recorded the first time. After ``max_restarts`` restarts a failure ends the job, as
without them.

When a stage cannot come back (its replacement dies or does not start: its device is gone), the job goes on with
the stages that remain, as vPipe's layer migration would: the same layers re-partitioned onto K-1 stages, balanced by
what they were measured to cost (``core/planning/fewer.py``), each new stage reading its units from whichever stage
held them in the snapshot, the lost GPU skipped. The session's stage count, memory budgets and plan follow, and the
restart's record says so.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from vpipe_lab.control.errors import WorkerError
from vpipe_lab.control.requests import Requests
from vpipe_lab.control.state import JobState
from vpipe_lab.control.workers.processes import Launcher
from vpipe_lab.core import documents
from vpipe_lab.core.change import Applied
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.fewer import fewer_stages
from vpipe_lab.wire import snapshot_format
from vpipe_lab.wire.commands import Run
from vpipe_lab.wire.jobspec import JobSpec

log = logging.getLogger(__name__)


@dataclass
class Restart:
    """One restart, as ``session.processes.restarts`` and the dashboard show it."""

    number: int  # 1 for the first
    time: float  # when the failure was named (seconds since the epoch)
    stage: int  # the stage that failed
    cause: str
    snapshot: int  # the iteration the pipeline went back to
    replayed: int  # iterations that had completed and ran again
    seconds: float  # from the failure being named to training again
    loss_diff: float | None = None  # the largest difference of a replayed iteration's loss from the first run's
    stages: int = 0  # the stages the job went on with (fewer than before when one could not come back)
    note: str = ""  # how the job went on without a stage, in words

    def to_dict(self) -> dict[str, Any]:
        return documents.dump(self)  # type: ignore[no-any-return]


class NotBack(RuntimeError):
    """A replacement worker that died or did not start: its stage cannot come back (its device is gone)."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(f"worker {rank}: {why}")
        self.rank, self.why = rank, why


class RestartHost(Protocol):
    """What the restarts need of the session's wiring they serve (``control/lifecycle.py``'s ``Lifecycle``)."""

    def forget_partial(self, stages: int | None = None) -> None:
        """The workers were replaced: drop what the ended ones reported of unfinished iterations."""

    def restarted(self, restart: Restart) -> None:
        """A restart is done: record it, and the stages the job went on with."""

    def layer_times(self) -> list[float] | None:
        """What each layer costs, for re-planning onto fewer stages (None: an even split)."""


class Restarter:
    """Owns the restarts of one launched session (the failure monitor's thread calls ``recover``)."""

    def __init__(self, limit: int, spec: JobSpec, job_dir: Path, launcher: Launcher, state: JobState,
                 requests: Requests, cond: threading.Condition, start_timeout: float, host: RestartHost) -> None:
        self.limit, self.spec, self.job_dir, self.launcher = limit, spec, job_dir, launcher
        self.state, self.requests, self.cond, self.start_timeout = state, requests, cond, start_timeout
        self.host = host
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
        found = snapshot_format.newest(self.root)
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
        with self.cond:
            self.requests.replaced(f"iteration {spec.start_iteration}, plan version "
                                  f"{found[1].plan_version if found else 0}")
        note = ""
        try:
            try:
                self._start(spec, f"job-restart-{number}.json")
            except NotBack as exc:  # that stage cannot come back: go on without it, if the job has stages to spare
                self.launcher.end_workers(timeout=2.0)
                spec, note = self._without(spec, exc)
                self._start(spec, f"job-restart-{number}-fewer.json")
        except Exception as exc:  # no replacement started: the job ends with the first failure's cause, and why
            log.error("the restart failed: %s", exc)
            self.launcher.end_workers(timeout=2.0)
            return WorkerError(error.stage, f"{error.cause}; it was not restarted: {exc}", traceback=error.traceback,
                               log_tail=error.log_tail, exit_code=error.exit_code, checkpoint=error.checkpoint,
                               iteration=error.iteration, microbatch=error.microbatch, action=error.action)
        start = spec.start_iteration
        restart = Restart(number, time.time(), error.stage, error.cause.splitlines()[0] if error.cause else "", start,
                          max(0, self.state.iteration - start), time.monotonic() - began, stages=spec.settings.stages,
                          note=note)
        self.done.append(restart)
        with self.cond:
            if note:  # the session's spec from now on: its stage count, budgets, devices and plan
                for key in ("settings", "plan", "devices"):
                    setattr(self.spec, key, getattr(spec, key))
                self.state.plan = Plan.from_dict(spec.plan)
                # in the record from the first iteration it records (the replayed ones were recorded under the old)
                self.state.applied.append(Applied(self.state.plan, self.state.plan_version, self.state.iteration,
                                                  source="restart"))
            elif found is not None:
                self.state.plan, self.state.plan_version = Plan.from_dict(found[1].plan), found[1].plan_version
        self._resume_training(start)
        restart.seconds = time.monotonic() - began
        self.host.restarted(restart)
        log.warning("restart %d of %d: stage %d %s, back at iteration %d, %d iteration(s) to replay, %.1f s",
                    number, self.limit, restart.stage,
                    f"planned away ({spec.settings.stages} stages now)" if note else "replaced",
                    start, restart.replayed, restart.seconds)
        return None

    def _start(self, spec: JobSpec, name: str) -> None:
        """Spawn every rank of ``spec`` and wait until each is ready; NotBack names the first that died or was late."""
        path = self.job_dir / name
        spec.save(path)
        workers = spec.settings.workers
        with self.cond:
            self.state.ready.clear()
            self.host.forget_partial(spec.settings.stages)
        for rank in range(workers):
            self.launcher.start_rank(rank, path)

        def ready() -> bool:
            for worker, rc in self.launcher.exited():
                if rc != 0:
                    how = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
                    raise NotBack(worker.rank, f"its replacement died as it started ({how})")
            return len(self.state.ready) >= workers

        try:
            self.requests.until(ready, self.start_timeout, "the replacement workers did not start")
        except TimeoutError:
            late = [r for r in range(workers) if r not in self.state.ready]
            raise NotBack(late[0], f"its replacement did not start within {self.start_timeout:g} s") from None

    def _without(self, spec: JobSpec, lost: NotBack) -> tuple[JobSpec, str]:
        """``spec`` for the stages that remain when ``lost``'s stage cannot come back (raises when the job cannot go
        on without it), and the words for what was done."""
        stage = lost.rank % spec.settings.stages
        if spec.settings.data_parallel > 1:
            raise RuntimeError(f"stage {stage} cannot come back ({lost.why}), and a job of {spec.settings.replicas} "
                               f"pipeline replicas x {spec.settings.shards} shards is not re-planned onto fewer stages")
        current = Plan.from_dict(spec.plan) if spec.plan else self.state.plan
        if current is None:
            raise RuntimeError(f"stage {stage} cannot come back ({lost.why}) and no plan is known to re-partition")
        fewer = fewer_stages(current, stage, self.host.layer_times())  # PlanError when one stage is all there was
        keep = [s for s in range(spec.settings.stages) if s != stage]
        budget = spec.settings.budgets
        changes: dict[str, Any] = {
            "settings": replace(spec.settings, stages=spec.settings.stages - 1,
                                memory_budget=tuple(budget[s] for s in keep) if budget else None),
            "plan": fewer.plan.to_dict(), "devices": [(spec.devices or list(range(spec.settings.stages)))[s] for s in keep]}
        note = f"stage {stage} could not come back: {lost.why}; going on with {fewer.how}"
        log.warning("%s", note)
        return replace(spec, **changes), note

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
