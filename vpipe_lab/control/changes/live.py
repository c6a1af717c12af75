"""Changing a running pipeline: plans, partitions, policies, the model itself; saving; vPipe's online replanning.

Every change is validated here first (a bad plan raises and changes nothing), then sent to rank 0, which applies it
on every rank at the next iteration boundary; the call returns the iteration from which it is in effect. ``Session``
exposes these as its own methods (``control/session.py``).
"""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vpipe_lab.control.changes.profiles import Profiles
from vpipe_lab.control.requests import Requests
from vpipe_lab.control.state import JobState, infos
from vpipe_lab.control.subscriptions import Events
from vpipe_lab.control.workers.monitor import FailureMonitor
from vpipe_lab.core import checks, schedules
from vpipe_lab.core.change import Applied, Change
from vpipe_lab.core.cost import scaling
from vpipe_lab.core.cost.calibration import Calibration
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.errors import InfeasiblePlan, PlanError
from vpipe_lab.core.plan import AUTO, Plan, default_virtual_stages
from vpipe_lab.core.planning.layer_moves import LayerMove, layer_moves, migration_time_s, moved_bytes
from vpipe_lab.core.planning.mesh import search_sharded
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.core.report import human_bytes
from vpipe_lab.wire.checkpoint_format import Manifest
from vpipe_lab.wire.commands import Apply, Save, SetModel
from vpipe_lab.wire.events import Refusal
from vpipe_lab.wire.jobspec import JobSpec
from vpipe_lab.wire.private import write_private

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replan:
    """What online replanning found: the plan, its predicted gain per iteration and the layer moves it takes."""

    plan: Plan
    current_s: float  # the running plan's iteration time under the measured profile
    predicted_s: float  # the new plan's
    moves: tuple[LayerMove, ...]
    migration_s: float  # predicted transfer time of the moves
    moved_bytes: int
    applied_at: int | None = None
    profile: ModelProfile | None = field(default=None, repr=False)

    @property
    def gain_s(self) -> float:
        return self.current_s - self.predicted_s

    @property
    def gain(self) -> float:
        return self.gain_s / self.current_s if self.current_s > 0 else 0.0


class Calibrating(Protocol):
    """How the plan in force runs against its simulation (the session's ``record``)."""

    def calibration(self, simulated_s: float) -> Calibration | None:
        """The factor the what-if applies to ``simulated_s``, once the plan in force has run long enough."""


class LiveHost(Protocol):
    """What a live change needs of the session it changes (``control/session.py``'s ``Session``): what it measures
    of the running job and how the plan in force compares with its simulation."""

    @property
    def record(self) -> Calibrating:
        """The record of the plans that ran."""

    def profile(self) -> ModelProfile:
        """Every layer's measured costs, asked of the workers now."""

    def newest_profile(self) -> ModelProfile:
        """The newest measured profile, asking the workers for one if none was measured."""

    def cluster(self) -> Cluster:
        """The running hardware as the planners see it."""


class Live:
    """Plan, model and checkpoint changes of a running job."""

    def __init__(self, spec: JobSpec, job_dir: Path | None, state: JobState, requests: Requests,
                 monitor: FailureMonitor, events: Events, profiles: Profiles, session: LiveHost) -> None:
        self.spec, self.job_dir, self.state, self.requests, self.monitor = spec, job_dir, state, requests, monitor
        self.events, self.profiles, self.session = events, profiles, session
        self._lock = threading.Lock()  # one change at a time
        # The schedules the workers know: launch() hands them every schedule registered by then.
        self._known = set(schedules.names()) if job_dir is not None else set(schedules.built_in())

    # --- plans --------------------------------------------------------------------------------------------------
    def change(self, change: Change, *, force: bool = False, checkpoint: bool = True,
               timeout: float | None = None) -> Applied:
        """Run the plan ``change`` asks for from the next iteration boundary, migrating layers live.

        Every door (the editor, the magics, ``Session.apply``/``set_partition``/``set_policy``, the planner) comes
        here with a typed ``Change``; it is checked once here and once on each worker (only a worker knows its
        memory). Raises PlanError (an invalid plan) or InfeasiblePlan (its estimate exceeds a stage's memory budget,
        unless ``force``) and then changes nothing. With ``checkpoint`` the state before a migration is saved first,
        so a worker dying during the move loses nothing (``WorkerError.checkpoint`` says where it is).
        """
        self.monitor.check(self.requests, self.spec.settings.timeout)
        current = self.state.plan
        assert current is not None
        plan = change.resolve(current, len(self.state.names), self.spec.settings.stages)
        if plan == current:  # nothing to move or tell the workers: no new version, and the caller is told so
            return Applied(current, self.state.plan_version, self.state.iteration, source=change.source, unchanged=True)
        self._admit(plan, current, force)
        # the number the door showed for this plan (the editor's what-if) is the prediction, else the same computation
        predicted = change.predicted_s if change.predicted_s is not None else self.predicted_s(plan, current)
        with self._lock:
            version = self.state.plan_version + 1
            moves = layer_moves(current.boundaries, plan.boundaries, plan.stages,
                                (current.placement, plan.placement))
            path = None
            if checkpoint and moves and self.job_dir is not None:
                path = self.job_dir / "checkpoints" / f"plan-v{version}"
            self.state.migrating = version if moves else None
            try:
                ack = self.requests.command(Apply(plan.to_dict(), version=version,
                                                  checkpoint=str(path) if path else None,
                                                  schedules=self._hand_over(plan, version)), timeout=timeout)
            finally:
                self.state.migrating = None
            if not ack.ok:
                failure = self.monitor.take_refusal(version)
                refusal = Refusal(failure.stage, failure.needed, failure.budget) if failure else ack.refused
                if refusal is None and ack.error:
                    raise PlanError(f"the plan was refused: {ack.error}; nothing moved")
                detail = (f": stage {refusal.stage} would need {human_bytes(refusal.needed)} of its "
                          f"{human_bytes(refusal.budget)}" if refusal else "")
                raise InfeasiblePlan(f"the migration was refused{detail}; nothing moved",
                                     stage=refusal.stage if refusal else -1,
                                     missing_bytes=refusal.needed - refusal.budget if refusal else 0)
            if path is not None:
                self._keep_checkpoint(path)
            done = Applied(plan, version, ack.iteration, len(moves), ack.moved_bytes or 0, ack.pause_s or 0.0,
                           change.source, predicted)
            self.state.plan, self.state.plan_version = plan, version
            self.state.applied.append(done)
            self.state.last_migration = {"version": version, "iteration": ack.iteration, "moves": len(moves),
                                         "moved_bytes": done.moved_bytes, "pause_s": done.pause_s}
            self.events.publish({"type": "plan", "plan": plan, "applied": done, "source": change.source,
                                 **self.state.last_migration})
            return done

    def _hand_over(self, plan: Plan, version: int) -> str | None:
        """A schedule registered in this process after the job started goes to the workers with the change that
        first runs it: pickled into the job directory, which every rank reads (an attached job's workers learn
        schedules from their own script: they refuse one they do not know, and nothing changes)."""
        if plan.schedule in self._known or self.job_dir is None:
            return None
        import cloudpickle

        path = self.job_dir / f"schedules-v{version}.pkl"
        write_private(path, cloudpickle.dumps([plan.kind]))
        self._known.add(plan.schedule)  # a refused change re-sends nothing the workers already registered
        return str(path)

    def _admit(self, plan: Plan, current: Plan, force: bool) -> None:
        """Refuse a checked plan this job cannot train (its settings) or whose estimate exceeds a stage's budget
        under the newest measured profile (no request to the workers when one is known)."""
        spec = self.spec
        if problem := plan.kind.training_refusal(spec.settings.clip_grad_norm, spec.settings.precision, spec.settings.replicas):
            raise PlanError(f"{problem}; nothing changed")
        if force or not spec.settings.memory_budget:
            return
        est = estimate(plan, self._sized(self.session.newest_profile(), plan, current), self.session.cluster())
        over = {s: o for s, o in enumerate(est.over_budget) if o > 0}
        if over:
            stage = max(over, key=over.__getitem__)
            raise InfeasiblePlan(
                f"the plan's estimate exceeds the memory budget: stage {stage} would need "
                f"{human_bytes(est.peak_bytes[stage])} of {human_bytes(est.budget_bytes[stage])}; nothing changed "
                f"(apply(plan, force=True) to run it anyway)",
                stage=stage, missing_bytes=over[stage],
                suggestions=("swap or recompute more of that stage's layers", "move layers off that stage"))

    @staticmethod
    def _sized(profile: ModelProfile, plan: Plan, current: Plan) -> ModelProfile:
        """``profile`` at ``plan``'s micro-batch size: the same global batch in another number of micro-batches."""
        if plan.microbatches == current.microbatches or not profile.microbatch_size:
            return profile
        batch = profile.microbatch_size * current.microbatches
        if batch % plan.microbatches:
            raise PlanError(f"{plan.microbatches} micro-batches do not divide the batch of {batch}; nothing changed")
        return scaling.at(profile, batch // plan.microbatches)

    def predicted_s(self, plan: Plan, current: Plan) -> float | None:
        """The simulated iteration time of ``plan`` under the newest profile, calibrated by the running plan's recent
        iterations against its own simulation (``core/cost/calibration.py``; what the editor's what-if shows), if a
        profile was measured (the record of the session keeps it beside what the plan then measured); None without
        one: nothing is asked of the workers."""
        profile = self.profiles.newest
        if profile is None or len(profile) != plan.num_layers:
            return None
        try:
            cluster = self.session.cluster()
            simulated = simulate(plan, self._sized(profile, plan, current), cluster).iteration_s
            if len(profile) != current.num_layers:
                return simulated
            found = self.session.record.calibration(simulate(current, profile, cluster).iteration_s)
            return found.apply(simulated) if found is not None else simulated
        except Exception as exc:  # a prediction is a nicety: the change goes ahead without one
            log.info("no prediction for %s: %s", plan.describe(), exc)
            return None

    def _keep_checkpoint(self, path: Path) -> None:
        """Only the newest automatic checkpoint is kept."""
        last = self.state.last_checkpoint
        if last is not None and last != path and self.job_dir is not None and self.job_dir in last.parents:
            shutil.rmtree(last, ignore_errors=True)
        self.state.last_checkpoint = path

    # --- state ----------------------------------------------------------------------------------------------------
    def save(self, path: str | Path, *, keep: int | None = None, timeout: float | None = None) -> Path:
        """Write parameters, optimizer state, plan and iteration at the next iteration boundary, as a new version
        of the checkpoint at ``path`` (a torch.distributed.checkpoint directory keyed by the model's own
        ``state_dict()`` names, checksummed, plus a manifest), switched to atomically: a crash during the save leaves
        the previous version intact. ``keep`` keeps only the newest versions. Returns the version's directory, which
        ``dcp.load(model.state_dict(), checkpoint_id=...)`` reads; ``launch(..., resume=path)`` restores the newest
        onto any partition."""
        checks.count(keep, "keep", optional=True, what="versions to keep")
        target = Path(path).absolute()
        ack = self.requests.command(Save(str(target), name=f"ckpt-{uuid.uuid4().hex[:12]}", keep=keep), timeout=timeout)
        if ack.ok is False:
            raise OSError(f"the checkpoint was not saved: {ack.error}; training goes on, and the previous "
                          f"version at {target} (if any) is intact")
        written = Manifest.read(target)  # complete, or this raises
        assert written.directory is not None
        return written.directory

    # --- the model itself (neural architecture search) ---------------------------------------------------------------
    def set_model(self, factory: Callable[[], Any], *, plan: Plan | None = None,
                  mapping: Mapping[int, int | None] | None = None, timeout: float | None = None) -> int:
        """Switch to the model ``factory()`` builds, from the next iteration. Layers of the new model keep the trained
        state of the old layers they match (by class and parameter shapes, in order; or ``mapping`` new -> old),
        new layers start fresh, and layers move between stages as the plan (default: an even split) requires."""
        import cloudpickle

        self.monitor.check(self.requests, self.spec.settings.timeout)
        if self.job_dir is None:
            raise PlanError("set_model needs a session started by launch(), which owns a job directory")
        if self.spec.settings.shards > 1:
            raise PlanError(f"set_model swaps the model in a pipeline of whole stages; this job shards each stage over "
                            f"{self.spec.settings.shards} ranks: save it, and launch the new model (resume= carries "
                            "the layers whose names and shapes match)")
        with self._lock:
            version = self.state.plan_version + 1
            path = self.job_dir / f"model-v{version}.pkl"
            write_private(path, cloudpickle.dumps(factory))
            cmd = SetModel(str(path), version=version, plan=plan.to_dict() if plan else None,
                           mapping={str(j): i for j, i in mapping.items()} if mapping is not None else None)
            ack = self.requests.command(cmd, timeout=timeout)
            if not ack.ok and ack.error and ack.names is None:
                raise PlanError(f"the new model cannot replace the running one: {ack.error}; nothing changed")
            if not ack.ok or ack.plan is None or ack.names is None or ack.mapping is None:
                raise InfeasiblePlan("the new model's layers do not fit where they would go; nothing changed",
                                     stage=-1, missing_bytes=0)
            self.state.plan = Plan.from_dict(ack.plan)
            self.state.names = list(ack.names)
            self.state.unit_info = infos(ack.units, self.state.names)
            self.profiles.forget()  # layer indices now mean other layers
            self.state.plan_version = version
            self.state.last_mapping = {int(j): i for j, i in ack.mapping.items()}
            self.events.publish({"type": "model", "version": version, "plan": self.state.plan,
                                 "iteration": ack.iteration, "layers": len(self.state.names)})
            return ack.iteration

    # --- vPipe's online planner ------------------------------------------------------------------------------------
    def replan(self, method: str = "vpipe", *, apply: bool = False, cluster: Cluster | None = None,
               profile: ModelProfile | None = None, choose_microbatches: bool = False,
               schedule: str | None = None) -> Replan:
        """Profile the running model, plan it from the current plan, and report the predicted gain and the moves;
        ``apply=True`` also applies the new plan (if it differs). ``choose_microbatches`` lets the planner choose
        the number of micro-batches too, for the same global batch, from the throughput-vs-micro-batch-size curve
        the profiler measured (``core/cost/scaling.py``); a new count is applied live like any other plan change.
        ``schedule``: plan for that schedule, or ``"auto"`` to let the planner choose it (each charged its memory
        and its measured overhead per step); None keeps the current one. A new schedule starts at the iteration
        the plan is applied at, like any other plan change."""
        if schedule is not None and schedule not in (*schedules.names(), AUTO):
            raise PlanError(f"unknown schedule {schedule!r}: use one of {', '.join((*schedules.names(), AUTO))}")
        profile = profile or self.session.profile()
        cluster = cluster or self.session.cluster()
        current = self.state.plan
        assert current is not None
        asked = schedule
        schedule = schedule or current.schedule
        # the job's mesh is its processes: a sharded job's planner chooses each stage's sharding on it
        mesh = {"shards": current.shards, "replicas": current.replicas}
        if choose_microbatches:
            if not profile.microbatch_size:
                raise PlanError("no iteration has run yet, so the micro-batch size is not known: run a few "
                                "iterations before choose_microbatches")
            result = search_sharded(profile, cluster, batch_size=profile.microbatch_size * current.microbatches,
                                    schedule=schedule, method=method, current=current, **mesh)
        else:
            # a chunked schedule keeps the session's chunks per stage (or takes its default when it is new)
            chunked = schedule != AUTO and schedules.get(schedule).chunked
            virtual = (current.virtual_stages if schedule == current.schedule else default_virtual_stages(schedule)
                       ) if chunked else 1
            result = search_sharded(profile, cluster, microbatches=current.microbatches, schedule=schedule,
                                    method=method, current=current, virtual_stages=virtual, **mesh)
        if (apply and result.plan.kind.asynchronous and not current.kind.asynchronous
                and asked != result.plan.schedule):
            # the method plans its own schedule: applying it would change what training computes, not only its speed
            raise PlanError(f"method={method!r} plans the {result.plan.schedule!r} schedule (weight stashing, an "
                            "optimizer step after every micro-batch), which changes the training's semantics: pass "
                            f"schedule={result.plan.schedule!r} to switch to it on purpose, or use "
                            "method='pipedream-flush' for its synchronous planner")
        now = estimate(current, profile, cluster).iteration_s
        if result.microbatch_size is not None:
            profile = scaling.at(profile, result.microbatch_size)  # the costs the chosen plan runs with
        moves = result.moves
        found = Replan(result.plan, now, result.estimate.iteration_s, moves,
                       migration_time_s(moves, profile, cluster), moved_bytes(moves, profile), None, profile)
        if apply and result.plan != current:
            at = self.change(Change.to(result.plan, "planner")).iteration
            found = Replan(found.plan, found.current_s, found.predicted_s, found.moves, found.migration_s,
                           found.moved_bytes, at, profile)
        return found

