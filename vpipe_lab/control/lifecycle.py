"""The Session's worker processes: as the user sees them (``session.processes``: their ids, what is left of them,
their exit codes, the restarts that replaced them) and the restart wiring between the Session's collaborators."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vpipe_lab.control.errors import WorkerError
from vpipe_lab.control.state import JobState
from vpipe_lab.control.workers.processes import Launcher
from vpipe_lab.control.workers.restarts import Restart, Restarter
from vpipe_lab.core.cost.breakdown import breakdown
from vpipe_lab.core.planning.fewer import spread
from vpipe_lab.telemetry.metrics import Metrics
from vpipe_lab.wire import protocol as P


class Processes:
    """A session's worker processes (``session.processes``): ids, exit codes, what is left of them, and restarts."""

    def __init__(self, launcher: Launcher | None, metrics: Metrics, state: JobState,
                 layers: Callable[[float | None], list[list[int]]] | None = None) -> None:
        self._launcher, self._metrics, self._state, self._layers = launcher, metrics, state, layers

    def started(self, rank: int) -> dict[str, Any]:
        """What ``rank`` reported when it started: its stage, device, backend, measured bandwidths, plan."""
        return ready.to_dict() if (ready := self._state.ready.get(rank)) is not None else {}

    @property
    def device(self) -> str:
        """What rank 0 runs on ("cpu", "cuda:0", ...)."""
        return str(self.started(0).get("device", "?"))

    def layers(self, timeout: float | None = None) -> list[list[int]]:
        """Which layers each stage holds now, as the workers themselves report it (at the next iteration boundary)."""
        if self._layers is None:
            raise RuntimeError("these processes were given no way to ask their workers (Processes(..., layers=None)); "
                               "ask the session's own: session.processes.layers()")
        return self._layers(timeout)

    def pids(self) -> dict[int, int]:
        """Each worker process's id by rank (a launched session's; after a restart, the replacements')."""
        return {w.rank: w.pid for w in self._launcher.workers} if self._launcher is not None else {}

    def remaining(self) -> list[int]:
        """The pids of this session's workers, and of anything they started, that still exist (zombies too)."""
        return self._launcher.remaining() if self._launcher is not None else []

    def exit_codes(self) -> dict[int, int | None]:
        """Each worker process's exit code by rank, None while it runs (a launched session's; not torchrun's)."""
        return {w.rank: w.popen.poll() for w in self._launcher.workers} if self._launcher is not None else {}

    @property
    def restarts(self) -> list[dict[str, Any]]:
        """Each restart so far (``launch(max_restarts=N)``), oldest first; ``metrics.restarts`` as a DataFrame."""
        return self._metrics.restart_records()


class Lifecycle:
    """The Session's wiring to its processes: the messages in, the wait while they start, and restarts. A mixin,
    because these are wired between the Session's own collaborators (failure monitor, intake, requests, launcher),
    which only the Session holds; none of it is a user's, so its names are underscored, and ``control/launch.py``,
    which builds the Session, is the one caller outside the class."""

    _spec: Any
    _state: Any
    metrics: Any
    _logger: Any
    stop: Callable[..., None]  # the Session's
    _launcher: Any
    _job_dir: Any
    _monitor: Any
    _intake: Any
    _requests: Any
    _events: Any
    _cond: Any
    _profiles: Any
    plan: Any
    _stages: int
    _workers: int
    _replicas: int

    # --- wiring (launch, attach) ------------------------------------------------------------------------------------
    def _receive(self, msg: P.Message) -> None:
        """Take one message from a worker (the channel's handler; it runs on the channel's thread)."""
        self._intake.receive(msg)

    def _starting(self, done: Callable[[], bool], timeout: float, late: Callable[[], tuple[int, str]]) -> None:
        """Wait for ``done()`` while workers start (``launch``); on a failure, or a timeout (``late()`` says which
        rank missed what), stop the workers and raise."""
        try:
            self._requests.until(done, timeout, "the workers did not start")
        except TimeoutError:
            rank, what = late()
            self._monitor.fail(WorkerError(rank % self._stages, f"{what} within {timeout:.0f} s"))
        except WorkerError:
            pass
        if (err := self._monitor.fatal) is not None:
            self.stop(timeout=2.0)  # nothing trains yet
            raise err

    def _restart_on_failure(self, limit: int, start_timeout: float) -> None:
        """From now on a failed worker is replaced and training goes back to the newest snapshot, ``limit`` times
        at most (``control/workers/restarts.py``); launch() calls this for ``max_restarts``."""
        if self._launcher is None or self._job_dir is None:
            raise RuntimeError("only a session that started its workers restarts them; a torchrun job restarts "
                               "through torchrun's own --max-restarts")
        restarter = Restarter(limit, self._spec, self._job_dir, self._launcher, self._state, self._requests, self._cond,
                              start_timeout, self._intake.forget_partial, self._restarted, self._layer_times)
        self._intake.on_replay = restarter.replayed
        self._monitor.recover = restarter.recover

    def _layer_times(self) -> list[float] | None:
        """What each layer costs, for re-planning onto fewer stages: the newest profile's, else each stage's measured
        compute over the last iterations shared by its layers, else None (an even split)."""
        newest = self._profiles.newest
        if newest is not None and len(newest) == self.plan.num_layers:
            return [layer.compute_s for layer in newest.layers]
        times = {t.stage: t.seconds("compute") for t in breakdown(self.metrics.timeline(10))}
        if sorted(times) != list(range(self.plan.stages)):
            return None
        return spread(self.plan, [times[s] for s in range(self.plan.stages)])

    def _restarted(self, restart: Restart) -> None:
        if restart.stages and restart.stages != self._stages:  # it went on without a stage that could not come back
            self._stages, self._workers = restart.stages, restart.stages * self._replicas
        self.metrics.add_restart(restart)
        self._logger.event(restart.snapshot, "restart", f"restart {restart.number}: stage {restart.stage} failed "
                          f"({restart.cause}); back to iteration {restart.snapshot}, {restart.replayed} replayed"
                          + (f"; {restart.note}" if restart.note else ""))
        self._events.publish({"type": "restarted", **restart.to_dict()})
