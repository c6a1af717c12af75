"""The Session's worker processes: as the user sees them (``session.processes``: their ids, what is left of them,
their exit codes, the restarts that replaced them), how many there are (``Ranks``) and the wiring between the
Session's collaborators that starts and restarts them (``Lifecycle``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vpipe_lab.control.changes.profiles import Profiles
from vpipe_lab.control.errors import WorkerError
from vpipe_lab.control.requests import Requests
from vpipe_lab.control.state import JobState
from vpipe_lab.control.subscriptions import Events
from vpipe_lab.control.workers import unit_preview
from vpipe_lab.control.workers.monitor import FailureMonitor
from vpipe_lab.control.workers.processes import Launcher
from vpipe_lab.control.workers.restarts import Restart, Restarter
from vpipe_lab.core.cost.breakdown import breakdown
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.fewer import spread
from vpipe_lab.core.settings import SettingError
from vpipe_lab.telemetry import sinks
from vpipe_lab.telemetry.metrics import Metrics
from vpipe_lab.telemetry.sinks import Logger
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.channel import Client, Endpoint
from vpipe_lab.wire.events import Welcome
from vpipe_lab.wire.jobspec import JobSpec


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


@dataclass
class Ranks:
    """How many stages the job runs now and how many data-parallel pipelines each has (shards x replicas: each shard
    of a stage reports as one); a restart that plans a stage away lowers ``stages``."""

    stages: int
    replicas: int

    @property
    def workers(self) -> int:
        """Worker processes (ranks)."""
        return self.stages * self.replicas


@dataclass(frozen=True)
class Opening:
    """How a launched Session starts its workers (``launch`` builds it): the job file they read, the launcher that
    spawns them, the model's fingerprint (its units are remembered under it), the metrics sink, the restarts allowed
    and the plan version a resumed job goes on from."""

    launcher: Launcher
    spec_path: Path
    model_key: str
    log: Any = None
    max_restarts: int = 0
    plan_version: int = 0


@dataclass(frozen=True)
class Joining:
    """How an attached Session takes over a running torchrun job (``attach`` builds it): the client its rank 0
    welcomed, what that welcome said, and how long to wait for the recent iterations it replays."""

    client: Client
    welcome: Welcome
    timeout: float


class Inbox(Protocol):
    """What the wiring needs of the Session's intake (``control/intake.py``, a sibling it may not import)."""

    on_replay: Callable[[int, float | None, float | None], None] | None

    def receive(self, msg: P.Message) -> None:
        """File one message from a worker."""

    def forget_partial(self, stages: int | None = None) -> None:
        """The workers were replaced: drop what the ended ones reported of unfinished iterations."""


class LifecycleHost(Protocol):
    """What the wiring needs of the Session it serves."""

    @property
    def plan(self) -> Plan:
        """The plan in force."""

    @property
    def names(self) -> list[str]:
        """The partition units' names, in order."""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the workers and release everything."""

    def detach(self) -> None:
        """Let go of a job this Session attached to, which trains on."""


class Lifecycle:
    """The Session's wiring to its processes: the messages in, the wait while they start, and restarts. It is wired
    between the Session's own collaborators (failure monitor, intake, requests, launcher); none of it is a user's.
    The Session opens with it: ``open`` for a launched job, ``join`` for an attached one."""

    def __init__(self, host: LifecycleHost, ranks: Ranks, spec: JobSpec, job_dir: Path | None,
                 launcher: Launcher | None, state: JobState, cond: threading.Condition, intake: Inbox,
                 requests: Requests, monitor: FailureMonitor, profiles: Profiles, metrics: Metrics, logger: Logger,
                 events: Events) -> None:
        self.host, self.ranks, self.spec, self.job_dir, self.launcher = host, ranks, spec, job_dir, launcher
        self.state, self.cond, self.intake, self.requests, self.monitor = state, cond, intake, requests, monitor
        self.profiles, self.metrics, self.logger, self.events = profiles, metrics, logger, events

    # --- wiring (launch, attach) ------------------------------------------------------------------------------------
    def open(self, hub: Endpoint, opening: Opening) -> None:
        """Start a launched job: take the hub's messages, open the metrics sink, spawn rank 0 (alone first when it
        scouts the model's units), then the rest, and wait until every rank is ready; then restarts, if allowed. A
        failure stops whatever started and raises."""
        hub.set_handler(self.receive)
        try:
            self.logger.sink = sinks.open_sink(opening.log)
        except Exception:
            self.host.stop()
            raise
        spec, state, launcher = self.spec, self.state, opening.launcher
        try:
            launcher.start_rank(0, opening.spec_path)
            if spec.scout:
                self.starting(lambda: state.units is not None, spec.settings.start_timeout,
                              lambda: (0, "rank 0 did not report the model's partition units"))
                if state.refused:
                    raise SettingError(state.refused)
                names = list(state.units or [])
                unit_preview.remember(opening.model_key, names)
                unit_preview.check(spec.settings.stages, names)
            for rank in range(1, spec.settings.workers):
                launcher.start_rank(rank, opening.spec_path)
        except Exception:
            self.host.stop(timeout=2.0)  # nothing trains yet: rank 0 at most waits for the others to join
            raise

        def late() -> tuple[int, str]:
            missing = sorted(set(range(self.ranks.workers)) - set(state.ready))
            return (missing or [0])[0], f"ranks {missing} did not start"

        self.starting(lambda: len(state.ready) >= self.ranks.workers, spec.settings.start_timeout, late)
        state.adopt([], None)
        unit_preview.remember(opening.model_key, self.host.names)
        if opening.max_restarts:
            self.restart_on_failure(opening.max_restarts, spec.settings.start_timeout)
        state.plan_version = opening.plan_version

    def join(self, joining: Joining) -> None:
        """Take over an attached job once every rank is ready (else let go and raise TimeoutError): what its ranks
        reported, then the recent iterations rank 0 replays, then its messages."""
        welcome = joining.welcome
        if len(welcome.ready) < self.ranks.workers:
            self.host.detach()
            raise TimeoutError(f"only {len(welcome.ready)} of {self.ranks.workers} ranks are ready yet; attach again "
                               "shortly")
        self.state.adopt(welcome.ready, welcome.current)
        joining.client.wait_replay(min(joining.timeout, 10.0))
        joining.client.set_handler(self.receive)  # the replayed recent iterations fill the metrics first

    def receive(self, msg: P.Message) -> None:
        """Take one message from a worker (the channel's handler; it runs on the channel's thread)."""
        self.intake.receive(msg)

    def starting(self, done: Callable[[], bool], timeout: float, late: Callable[[], tuple[int, str]]) -> None:
        """Wait for ``done()`` while workers start (``launch``); on a failure, or a timeout (``late()`` says which
        rank missed what), stop the workers and raise."""
        try:
            self.requests.until(done, timeout, "the workers did not start")
        except TimeoutError:
            rank, what = late()
            self.monitor.fail(WorkerError(rank % self.ranks.stages, f"{what} within {timeout:.0f} s"))
        except WorkerError:
            pass
        if (err := self.monitor.fatal) is not None:
            self.host.stop(timeout=2.0)  # nothing trains yet
            raise err

    def restart_on_failure(self, limit: int, start_timeout: float) -> None:
        """From now on a failed worker is replaced and training goes back to the newest snapshot, ``limit`` times
        at most (``control/workers/restarts.py``); ``open`` calls this for ``max_restarts``."""
        if self.launcher is None or self.job_dir is None:
            raise RuntimeError("only a session that started its workers restarts them; a torchrun job restarts "
                               "through torchrun's own --max-restarts")
        restarter = Restarter(limit, self.spec, self.job_dir, self.launcher, self.state, self.requests, self.cond,
                              start_timeout, self)
        self.intake.on_replay = restarter.replayed
        self.monitor.recover = restarter.recover

    def forget_partial(self, stages: int | None = None) -> None:
        """The workers were replaced: the intake drops what the ended ones reported of unfinished iterations."""
        self.intake.forget_partial(stages)

    def layer_times(self) -> list[float] | None:
        """What each layer costs, for re-planning onto fewer stages: the newest profile's, else each stage's measured
        compute over the last iterations shared by its layers, else None (an even split)."""
        newest, plan = self.profiles.newest, self.host.plan
        if newest is not None and len(newest) == plan.num_layers:
            return [layer.compute_s for layer in newest.layers]
        times = {t.stage: t.seconds("compute") for t in breakdown(self.metrics.timeline(10))}
        if sorted(times) != list(range(plan.stages)):
            return None
        return spread(plan, [times[s] for s in range(plan.stages)])

    def restarted(self, restart: Restart) -> None:
        """A restart is done: the stages the job goes on with, the restart in the metrics, the log and the events."""
        if restart.stages and restart.stages != self.ranks.stages:  # it went on without a stage that could not come back
            self.ranks.stages = restart.stages
        self.metrics.add_restart(restart)
        self.logger.event(restart.snapshot, "restart", f"restart {restart.number}: stage {restart.stage} failed "
                          f"({restart.cause}); back to iteration {restart.snapshot}, {restart.replayed} replayed"
                          + (f"; {restart.note}" if restart.note else ""))
        self.events.publish({"type": "restarted", **restart.to_dict()})
