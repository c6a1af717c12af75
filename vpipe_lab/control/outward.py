"""What leaves a running Session for other tools, and what comes in from them: the trained model's tensors, the
model in its library's own format, the plan as an export bundle, a production config as a plan (``Outward``, a
collaborator of ``control/session.py``'s ``Session``, whose public methods say what each does)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from vpipe_lab.control import weights
from vpipe_lab.control.changes import interop
from vpipe_lab.core.plan import Plan
from vpipe_lab.wire.commands import State
from vpipe_lab.wire.events import Tensors

if TYPE_CHECKING:
    from vpipe_lab.control.requests import Requests
    from vpipe_lab.control.state import JobState
    from vpipe_lab.control.workers.monitor import FailureMonitor
    from vpipe_lab.core.profile import Cluster, ModelProfile
    from vpipe_lab.core.settings import Settings
    from vpipe_lab.telemetry.metrics import Metrics
    from vpipe_lab.wire.jobspec import JobSpec


class OutwardHost(Protocol):
    """What an export reads of the running session (``control/session.py``'s ``Session``)."""

    @property
    def plan(self) -> Plan:
        """The plan in force."""

    @property
    def plan_version(self) -> int:
        """The plan in force's version."""

    @property
    def iteration(self) -> int:
        """Iterations completed."""

    @property
    def closed(self) -> bool:
        """Stopped or detached."""

    def profile(self) -> ModelProfile:
        """Every layer's measured costs, asked of the workers now."""

    def cluster(self) -> Cluster:
        """The running hardware as the planners see it."""

    def apply(self, plan: Plan) -> int:
        """Run ``plan`` from the next iteration boundary."""


class Outward:
    """The Session's exports and imports, over its requests, state, metrics and failure monitor."""

    def __init__(self, session: OutwardHost, requests: Requests, state: JobState, metrics: Metrics,
                 monitor: FailureMonitor, spec: JobSpec) -> None:
        self.session, self.requests, self.state, self.metrics = session, requests, state, metrics
        self.monitor, self.spec = monitor, spec  # the job's: a restart that plans a stage away gives it fewer

    @property
    def settings(self) -> Settings:
        return self.spec.settings

    def state_dict(self, timeout: float | None) -> Any:
        """Every stage's tensors gathered into ``model.state_dict()``'s keys and order."""
        self.monitor.check(self.requests, self.settings.timeout)
        return weights.assemble(self.requests.gather(State(), Tensors, self.settings.stages, timeout))

    def export(self, path: str | Path, model: Any, timeout: float | None) -> Path:
        """The trained weights loaded into a fresh build of ``model``, written in its library's format."""
        if model is None:
            raise ValueError("this session does not know how to build its model (it was attached): give "
                             "export(path, model=factory)")
        return weights.export(self.state_dict(timeout), model, path, self.settings.seed)

    def export_plan(self, path: str | Path, plan: Plan | None, microbatch_size: int) -> Path:
        """The bundle of ``plan`` (default: the plan in force), with what the lab measured and predicts for it."""
        session = self.session
        plan = plan if plan is not None else session.plan
        measured = interop.measured_s(self.metrics.records(200), session.plan_version) if plan == session.plan else None
        profile = cluster = None
        if session.iteration > 0 and not session.closed:
            profile, cluster = session.profile(), session.cluster()
        bundle = interop.bundle_of(plan, self.state.unit_info, microbatch_size=microbatch_size, profile=profile,
                                   cluster=cluster, measured=measured)
        return interop.write(path, bundle)

    def import_plan(self, source: Any, apply: bool, **kw: Any) -> Plan:
        """A production config read as a plan over the session's units; ``apply`` runs it."""
        plan = interop.read(source, self.state.unit_info, self.session.plan, **kw)
        if apply:
            self.session.apply(plan)
        return plan
