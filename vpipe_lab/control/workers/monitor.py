"""The failure monitor: collects what workers report, notices dead ones, and names the root cause of a failure.

A thread delivers queued events and checks the worker processes every 50 ms. When a stage fails, its neighbours fail
too (their transfers break); the monitor gathers evidence for half a second, then reports the stage that failed
first-hand (its own exception beats a stage that died without a word, which beats a broken connection), stops the
other workers and emits a "failed" event (the views freeze on it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vpipe_lab.control.errors import BudgetError, DataError, NonFiniteLoss, SessionClosed, WorkerError
from vpipe_lab.control.requests import Requests
from vpipe_lab.control.state import JobState
from vpipe_lab.control.subscriptions import Events
from vpipe_lab.control.workers.processes import Launcher
from vpipe_lab.wire.checkpoint_format import LATEST
from vpipe_lab.wire.events import Failure

log = logging.getLogger(__name__)


def where(body: Failure) -> dict[str, Any]:
    """A report's iteration, micro-batch and action, as WorkerError takes them."""
    return {"iteration": body.iteration, "microbatch": body.microbatch, "action": body.action}


class FailureMonitor:
    def __init__(self, launcher: Launcher | None, job_dir: Path | None, state: JobState, events: Events,
                 cond: threading.Condition) -> None:
        self.launcher, self.job_dir, self.state, self.events, self.cond = launcher, job_dir, state, events, cond
        self.fatal: WorkerError | None = None
        self.budget: BudgetError | DataError | NonFiniteLoss | None = None  # why training paused, not yet raised to the user
        self.stopping = False  # a stop was asked for: exits are expected
        self.closed = False
        self.refusals: dict[int, Failure] = {}  # plan version -> a stage's refusal to take layers
        self._reports: dict[int, Failure] = {}  # stage -> its error report
        self._trouble_since = 0.0
        # With max_restarts: replaces the workers and returns None (training goes on), or the error that ends the job
        self.recover: Callable[[WorkerError], WorkerError | None] | None = None
        self.recovering = False
        self._quiet_until = 0.0
        self._thread = threading.Thread(target=self._watch, name="vpipe-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.closed = True
        self._thread.join(timeout=2)

    def expect_exits(self) -> None:
        """A stop was asked for: workers exiting from now on is no failure."""
        self.stopping = True

    def paused_reported(self) -> bool:
        """Training paused for a reason not yet raised, and every iteration before it has reported: rank 0 finds a bad
        batch of iteration N at the boundary, before the other stages' reports of iteration N-1 (other sockets) may
        have arrived, and ``wait()`` raising then would show the session an iteration short."""
        err = self.budget
        return err is not None and (not isinstance(err, (DataError, NonFiniteLoss))
                                    or self.state.iteration >= err.iteration)

    def take_budget(self) -> BudgetError | DataError | NonFiniteLoss | None:
        """Why the workers paused (an over-budget iteration, a bad batch), not yet raised to the user, once (the
        next call returns None)."""
        with self.cond:
            err, self.budget = self.budget, None
            return err

    def check(self, requests: Requests, timeout: float) -> None:
        """Raise what ended the job (a worker's failure, a stop) or paused it (an over-budget iteration, a bad batch:
        once, after the reports of the iterations before it have arrived); return when training can go on."""
        if self.fatal is not None:
            raise self.fatal
        if self.closed:
            raise SessionClosed("this session was stopped; start a new one with vpipe_lab.launch()")
        if (err := self.take_budget()) is not None:  # raised with the earlier iterations' reports in
            requests.settle(lambda: self.state.iteration >= getattr(err, "iteration", 0), timeout)
            raise err

    def take_refusal(self, version: int) -> Failure | None:
        """A stage's refusal to take the layers of plan ``version``, once."""
        with self.cond:
            return self.refusals.pop(version, None)

    def on_error(self, body: Failure) -> None:
        """An ERROR message (called under ``cond``)."""
        if body.kind == "migration":
            self.refusals[body.version] = body
        elif body.kind == "data":
            self.state.paused = True
            self.budget = DataError(body.iteration, body.cause)
        elif body.kind == "loss":  # a NaN/inf loss under nonfinite="pause": every rank paused before the step
            self.state.paused = True
            if not isinstance(self.budget, NonFiniteLoss) or self.budget.iteration != body.iteration:  # replicas: 1st
                self.budget = NonFiniteLoss(body.iteration, body.microbatch, body.stage, body.cause, body.taken)
        elif body.kind == "budget":
            self.state.paused = True  # every rank paused at this boundary
            self.budget = BudgetError(body.stage, body.used, body.budget, [tuple(x) for x in body.layers],
                                      body.iteration, taken=body.taken)
        elif not self.stopping and time.monotonic() >= self._quiet_until:
            self._reports[body.stage] = body
            self._trouble_since = self._trouble_since or time.monotonic()

    def fail(self, error: WorkerError) -> None:
        with self.cond:
            self.fatal = error
            self.cond.notify_all()

    def _watch(self) -> None:
        """Deliver events, notice dead workers within ~0.1 s, stop the others on any failure."""
        while not self.closed:
            self.events.deliver()
            if self.launcher is not None and not self.stopping and self.fatal is None:
                if any(rc != 0 for _, rc in self.launcher.exited()):
                    self._trouble_since = self._trouble_since or time.monotonic()
                # Gather evidence for a moment: a killed stage makes its neighbours fail too, and the root cause
                # (the stage that died or raised first-hand) should be what the user reads.
                if self._trouble_since and time.monotonic() - self._trouble_since > 0.5:
                    self._failed(self.root_cause())
            if self.fatal is not None and self.launcher is not None and self.launcher.alive():
                log.error("%s; stopping the other workers", str(self.fatal).splitlines()[0])
                self.launcher.terminate(timeout=2.0, keep=self.fatal.checkpoint)
                self.events.emit({"type": "failed", "stage": self.fatal.stage, "cause": self.fatal.cause})
            time.sleep(0.05)

    def _failed(self, error: WorkerError) -> None:
        """The job failed with ``error``: restart it (``recover``) if it may, else end it with the error."""
        if self.recover is not None:
            self.recovering = True
            self.events.emit({"type": "restarting", "stage": error.stage, "cause": error.cause})
            try:
                ended = self.recover(error)
            except Exception:  # a restart that went wrong ends the job with the failure it answered
                log.exception("the restart failed")
                ended = error
            finally:
                self.recovering = False
            self._reports.clear()
            self._trouble_since = 0.0
            # What the ended workers said as they went may still be on its way: it is not the new workers' failure
            self._quiet_until = time.monotonic() + 1.0
            if ended is None or self.stopping:
                return
            error = ended
        with self.cond:
            self.fatal = error
            self.cond.notify_all()

    def _checkpoint(self) -> str | None:
        """The state a failure can be recovered from: the checkpoint taken before the migration under way, else the
        last automatic one."""
        last = str(self.state.last_checkpoint) if self.state.last_checkpoint else None
        if self.state.migrating is None or self.job_dir is None:
            return last
        path = self.job_dir / "checkpoints" / f"plan-v{self.state.migrating}"
        return str(path) if (path / LATEST).exists() else last

    def root_cause(self) -> WorkerError:
        """A stage's own exception beats a stage that died without a word, which beats a broken connection."""
        launcher = self.launcher
        workers = {w.rank: w for w in launcher.workers} if launcher else {}

        def tail(stage: int) -> str:
            return workers[stage].tail() if stage in workers else ""

        ckpt = self._checkpoint()

        def secondhand(body: Failure) -> bool:  # a broken connection: the effect of another stage's failure
            cause = body.cause
            return cause.startswith("CommError") or any(
                text in cause for text in ("Connection reset by peer", "Connection closed by peer", "Broken pipe"))

        own = {s: b for s, b in self._reports.items() if not secondhand(b)}
        if own:
            stage = min(own)
            return WorkerError(stage, own[stage].cause, traceback=own[stage].traceback, log_tail=tail(stage),
                               checkpoint=ckpt, **where(own[stage]))
        dead = [(w, rc) for w, rc in (launcher.exited() if launcher else []) if w.rank not in self._reports]
        if dead:
            w, rc = dead[0]
            cause = f"the worker process was killed by signal {-rc}" if rc < 0 else f"the worker process exited with code {rc}"
            if rc == -9:
                cause += " (SIGKILL: out of memory, or killed from outside)"
            # it said nothing: the iteration the job was in is the best known (none when it was not training)
            target = self.state.target
            training = not self.state.paused and (target is None or self.state.iteration < target)
            return WorkerError(w.rank, cause, log_tail=w.tail(), exit_code=rc, checkpoint=ckpt,
                               iteration=self.state.iteration if training else -1)
        silent = [w.rank for w in (launcher.workers if launcher else [])
                  if w.rank not in self._reports and w.popen.poll() is None]
        if silent:  # neighbours timed out waiting for a stage that is alive but says nothing: it is stuck
            stage, (waiter, body) = silent[0], min(self._reports.items())
            return WorkerError(stage, f"stage {stage} stopped responding: stage {waiter} gave up waiting for it "
                                      f"({(body.cause.splitlines() or [''])[0]}); it is alive but stuck (a hang in "
                                      "user code, a deadlock): its stack is in its log (kill -USR1 dumps it)",
                               log_tail=tail(stage), checkpoint=ckpt)
        stage = min(self._reports)
        body = self._reports[stage]
        return WorkerError(stage, body.cause, traceback=body.traceback, log_tail=tail(stage), checkpoint=ckpt,
                           **where(body))
