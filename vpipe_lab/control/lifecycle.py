"""The Session's worker processes as the user sees them: their ids, what is left of them, their exit codes, and the
restarts that replaced them (mixed into ``control/session.py``'s ``Session``, whose collaborators it wires)."""

from __future__ import annotations

from typing import Any

from vpipe_lab.control.workers.restarts import Restart, Restarter
from vpipe_lab.core.cost.breakdown import breakdown
from vpipe_lab.core.planning.fewer import spread


class Lifecycle:
    """The Session's processes and restarts. A mixin, because a restart is wired between the Session's own
    collaborators (failure monitor, intake, requests, launcher), which only the Session holds."""

    spec: Any
    state: Any
    metrics: Any
    logger: Any
    _launcher: Any
    _job_dir: Any
    _monitor: Any
    _intake: Any
    _requests: Any
    _events: Any
    _cond: Any
    _profiles: Any
    plan: Any
    stages: int
    workers: int
    replicas: int

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
        return self.metrics.restart_records()

    def restart_on_failure(self, limit: int, start_timeout: float) -> None:
        """From now on a failed worker is replaced and training goes back to the newest snapshot, ``limit`` times
        at most (``control/workers/restarts.py``); launch() calls this for ``max_restarts``."""
        if self._launcher is None or self._job_dir is None:
            raise RuntimeError("only a session that started its workers restarts them; a torchrun job restarts "
                               "through torchrun's own --max-restarts")
        restarter = Restarter(limit, self.spec, self._job_dir, self._launcher, self.state, self._requests, self._cond,
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
        if restart.stages and restart.stages != self.stages:  # it went on without a stage that could not come back
            self.stages, self.workers = restart.stages, restart.stages * self.replicas
        self.metrics.add_restart(restart)
        self.logger.event(restart.snapshot, "restart", f"restart {restart.number}: stage {restart.stage} failed "
                          f"({restart.cause}); back to iteration {restart.snapshot}, {restart.replayed} replayed"
                          + (f"; {restart.note}" if restart.note else ""))
        self._events.publish({"type": "restarted", **restart.to_dict()})
