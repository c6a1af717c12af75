"""The ``Session``: a running pipeline, driven from Python or a notebook while it trains in the background.

It holds no tensors and needs no torch: workers talk to each other directly (torch.distributed) and to it over an
authenticated ZeroMQ channel (``wire/channel.py``). A small public object over collaborators: ``Intake`` files
incoming messages (hub thread), ``Requests`` sends commands and waits for answers, ``FailureMonitor`` names the root
cause of a failure (monitor thread, which also delivers ``Events``), ``Live`` carries out plan, model and checkpoint
changes, ``MemoryTable`` sets each worker's predicted memory beside its measured, ``Lifecycle`` wires the workers'
start and restarts. ``launch()`` and ``attach()`` (``control/launch.py``) build it; docs/architecture.md has the
threads and the message flow."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vpipe_lab.control.changes.autoplan import AutoReplanner
from vpipe_lab.control.changes.live import Live, Replan
from vpipe_lab.control.changes.profiles import Profiles
from vpipe_lab.control.errors import WorkerError
from vpipe_lab.control.evaluation import evaluate
from vpipe_lab.control.history import History
from vpipe_lab.control.intake import Intake
from vpipe_lab.control.lifecycle import Joining, Lifecycle, Opening, Processes, Ranks
from vpipe_lab.control.memory_view import MemoryTable
from vpipe_lab.control.outward import Outward
from vpipe_lab.control.record import Record
from vpipe_lab.control.requests import Requests
from vpipe_lab.control.sessions import register
from vpipe_lab.control.state import JobState
from vpipe_lab.control.subscriptions import EventCallback, Events
from vpipe_lab.control.workers.monitor import FailureMonitor
from vpipe_lab.control.workers.processes import Launcher
from vpipe_lab.core import checks
from vpipe_lab.core.change import Applied, Change
from vpipe_lab.core.cost.breakdown import breakdown
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.deprecated import Deprecated
from vpipe_lab.core.plan import Plan, Policy
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.core.settings import Settings
from vpipe_lab.telemetry.metrics import Metrics, breakdown_frame, chunk_frame
from vpipe_lab.telemetry.runlog import RunLog
from vpipe_lab.telemetry.sinks import Logger
from vpipe_lab.wire.channel import Endpoint
from vpipe_lab.wire.commands import Command, Pause, Profile, Resume, Run, Stop, Telemetry
from vpipe_lab.wire.events import Ack, Layers
from vpipe_lab.wire.jobspec import JobSpec

log = logging.getLogger(__name__)


class Session:
    """A running pipeline. Every method is safe to call while training goes on in the background. Beside what a user
    does with a running job, it hands out ``metrics`` (what the workers measured), ``record`` (every plan that ran:
    history, compare, revert) and ``processes`` (worker pids, exit codes, restarts)."""

    # Public before; kept one release, warning (issue #59): the public face is the documented one.
    spec = Deprecated("_spec", "session.settings (the job's settings) and session.plan")
    model = Deprecated("_model", "the model you passed to launch()")
    stages = Deprecated("_ranks.stages", "session.plan.stages")
    replicas = Deprecated("_ranks.replicas", "session.plan.replicas (and session.plan.shards)")
    workers = Deprecated("_ranks.workers", "session.processes (its pids) or session.plan.devices")
    logger = Deprecated("_logger", "launch(log=...)")
    state = Deprecated("_state", "session.iteration, session.plan, session.status")

    def __init__(self, spec: JobSpec, hub: Endpoint, launcher: Launcher | None, job_dir: Path | None,
                 model: Any = None, *, opening: Opening | None = None, joining: Joining | None = None) -> None:
        self._spec = spec
        self._model = model  # what builds the trained model (factory, instance or bundled name): export() uses it
        # replicas: the data-parallel pipelines that report (shards x replicas: each shard of a stage runs one)
        self._ranks = ranks = Ranks(spec.settings.stages, spec.settings.data_parallel)
        self.metrics = Metrics()
        self._logger = Logger(None)  # launch(log=...) sets the sink (telemetry/sinks.py)
        self._state = JobState(iteration=spec.start_iteration, target=spec.start_iteration)
        self._hub, self._launcher, self._job_dir = hub, launcher, job_dir
        self._cond = cond = threading.Condition()
        self._events = Events()
        self._monitor = FailureMonitor(launcher, job_dir, self._state, self._events, cond)
        self._requests = Requests(hub, spec.settings.timeout, cond, lambda: self._monitor.fatal)
        self._intake = Intake(ranks.stages, ranks.replicas, self._state, self.metrics, self._requests, self._monitor,
                              self._events, self._logger, cond)
        self._runlog: RunLog | None = None
        if spec.settings.run_dir and launcher is not None:  # vpipe-lab run --run-dir: metrics.jsonl as it trains
            self._runlog = RunLog(Path(spec.settings.run_dir), ranks.stages, spec.start_iteration, replicas=ranks.replicas)
            self._intake.observer = self._runlog.observe
        self._profiles = Profiles()
        self._history = History(self._state, self.metrics, cond)  # session.record (control/record.py)
        self._events.subscribe(self._history.observe)
        self.record = Record(self._history, self.change, lambda: ranks.stages)
        self.processes = Processes(launcher, self.metrics, self._state, self._layers_by_stage)
        self._memory = MemoryTable(self, self._profiles)
        self._outward = Outward(self, self._requests, self._state, self.metrics, self._monitor, spec)
        self._live = Live(spec, job_dir, self._state, self._requests, self._monitor, self._events, self._profiles, self)
        self._autoplan: AutoReplanner | None = None
        self._lifecycle = Lifecycle(self, ranks, spec, job_dir, launcher, self._state, cond, self._intake,
                                    self._requests, self._monitor, self._profiles, self.metrics, self._logger,
                                    self._events)
        self._monitor.start()
        register(self)  # the %vpipe magics act on the newest session, however it was started
        if opening is not None:  # launch(): start the workers and wait until every rank is ready
            self._lifecycle.open(hub, opening)
        elif joining is not None:  # attach(): take over a torchrun job's ranks
            self._lifecycle.join(joining)

    # --- state ---------------------------------------------------------------------------------------------------
    @property
    def settings(self) -> Settings:
        """The job's settings (``core/settings.py``) as validated; after a stage was planned away, with fewer stages."""
        return self._spec.settings

    @property
    def iteration(self) -> int:
        """Iterations completed so far."""
        return self._state.iteration

    @property
    def plan(self) -> Plan:
        assert self._state.plan is not None
        return self._state.plan

    plan_version = property(lambda self: self._state.plan_version, doc="The plan in force's version (0: the first).")

    @property
    def names(self) -> list[str]:
        """The partition units' names, in order."""
        return self._state.names

    num_layers = property(lambda self: len(self._state.names), doc="How many partition units the model has.")

    @property
    def eager(self) -> dict[str, list[str]]:
        """The units that run part of the model eagerly, by unit name: the modules torch.export could not trace (a
        branch on a tensor's values), called as PyTorch calls them inside their unit (docs/models.md)."""
        return {u.name: list(u.eager) for u in self._state.unit_info if u.eager}

    last_migration = property(lambda self: self._state.last_migration, doc="The newest live change, as a dict.")

    @property
    def applied(self) -> list[Applied]:
        """Every live change in force so far (plan, version, iteration, moves, who asked), oldest first."""
        return list(self._state.applied)

    last_mapping = property(lambda self: self._state.last_mapping, doc="set_model's new -> old layer mapping.")

    # --- the record of plans (``record``: these three are the ones users reach for) -----------------------------
    history = property(lambda self: self.record.history, doc="Every plan that ran, a row each: ``record.history``.")

    def revert(self, entry: int, *, force: bool = False, timeout: float | None = None) -> Applied:
        """Run ``history`` entry ``entry``'s plan again from the next iteration boundary (``record.revert``)."""
        return self.record.revert(entry, force=force, timeout=timeout)

    def compare(self, a: int, b: int) -> Any:
        """Entries ``a`` and ``b`` of the ``history`` side by side, a row per stage (``record.compare``)."""
        return self.record.compare(a, b)

    @property
    def failure(self) -> WorkerError | None:
        """Why the workers stopped, when one of them failed."""
        return self._monitor.fatal

    @property
    def closed(self) -> bool:
        """Stopped (or detached): nothing more can be asked of the workers."""
        return self._monitor.closed

    @property
    def status(self) -> str:
        """'stopped', 'failed', 'restarting' (max_restarts: a failed worker is being replaced), 'paused' (by pause()
        or an over-budget iteration: resume() or run() go on), 'running' (iterations are asked for), or 'idle' (the
        iterations asked for are done)."""
        if self.closed or self.failure is not None:
            return "stopped" if self.closed else "failed"
        target = self._state.target
        return ("restarting" if self._monitor.recovering else "paused" if self._paused else
                "running" if target is None or self._state.iteration < target else "idle")

    _paused = property(lambda self: self._state.paused and not self.closed and self.failure is None)

    def _check(self) -> None:
        self._monitor.check(self._requests, self.settings.timeout)

    def cluster(self) -> Cluster:
        """The running hardware as the planners see it: budgets, bandwidths, time per step (``JobState.cluster``)."""
        m = self.metrics
        return self._state.cluster(self._ranks.stages, self.settings.budgets, m.timeline(20).step_overhead_s(),
                                  m.iteration_gap_s())

    def on_event(self, callback: EventCallback) -> Callable[[], None]:
        """Call ``callback(event)`` (from a background thread) for every event; returns an unsubscribe function.
        Event types: "iteration" (with the iteration's spans and per-stage memory), "plan", "model", "migrated",
        "evaluated", "replan", "ack" (rank 0 acknowledged a "command" at an "iteration"), "error" (a worker's
        report, e.g. over budget), "failed" (the job failed: stage and cause) and "closed" (stopped or detached)."""
        return self._events.subscribe(callback)

    # --- training ------------------------------------------------------------------------------------------------
    def _command(self, cmd: Command, timeout: float | None = None) -> Ack:
        self._check()
        return self._requests.command(cmd, timeout)

    def run(self, iterations: int | None = None) -> int | None:
        """Train ``iterations`` more iterations (None: until stopped) in the background; returns the target."""
        checks.count(iterations, "iterations", 0, optional=True)
        # Not paused from the moment it is asked: a pause the workers report after (a bad batch, a budget) wins.
        self._state.paused = False
        self._state.target = self._command(Run(iterations=iterations)).target
        return self._state.target

    def wait(self, iteration: int | None = None, timeout: float | None = None) -> int:
        """Block until ``iteration`` iterations are done (default: the last run()'s target); returns the count. One not
        reachable as things stand (idle short of it, paused) raises at once, why; a timeout says where it stood."""
        checks.count(iteration, "the iteration to wait for", minimum=0, optional=True,
                     what="an iteration count: wait(10) returns once 10 iterations are done")
        goal = iteration if iteration is not None else self._state.target
        if goal is None:
            raise ValueError("run() was asked to train until stopped: give wait() an iteration to wait for")
        self._check()

        def why() -> str | None:  # why the goal cannot be reached now (None: it still can)
            return self._state.unreachable(goal, self._paused)

        self._requests.until(lambda: self._state.iteration >= goal or self.closed or self._monitor.paused_reported()
                             or why() is not None, timeout, lambda: f"iteration {goal} not reached (at {self.iteration})")
        self._check()
        if why() is not None:
            raise RuntimeError(f"iteration {goal} will not be reached: {why()}")
        return self._state.iteration

    def pause(self) -> int:
        """Pause at the next iteration boundary; returns the iteration it paused before (when it returns, every
        iteration before that one is in ``metrics``)."""
        at = self._command(Pause()).iteration
        self._state.paused = True
        # Rank 0 acknowledges at the boundary; the other stages' reports may still be on their way (other sockets).
        self._requests.until(lambda: self._state.iteration >= at, self.settings.timeout,
                             f"the reports of the iterations before {at} did not arrive")
        return at

    def resume(self) -> int:
        """Go on training after pause() or an over-budget iteration; returns the iteration it resumed at."""
        self._state.paused = False  # before the command: a pause the workers report after it wins
        return self._command(Resume()).iteration

    def set_telemetry(self, spans: bool) -> int:
        """Stream per-action spans (timelines) or not from the next iteration (summaries and memory always)."""
        return self._command(Telemetry(spans=bool(spans))).iteration

    # --- what the workers know -----------------------------------------------------------------------------------
    def _layers(self, reset: bool, timeout: float | None = None) -> list[Layers]:
        self._check()
        return self._requests.gather(Profile(reset=reset), Layers, self._ranks.stages, timeout)

    def profile(self, reset: bool = False, timeout: float | None = None) -> ModelProfile:
        """Every layer's measured costs per micro-batch (medians over the profiling iterations since the last reset)."""
        measures = [m for answer in self._layers(reset, timeout) for m in answer.layers]
        return self._profiles.merge(measures, self._microbatch_size())

    def breakdown(self, last: int = 10, chunks: bool = False) -> Any:
        """Where each stage's (``chunks``: each chunk's) time went over the last ``last`` iterations, measured
        (``metrics.breakdown``), beside the same split of the running plan's simulated iteration (``predicted_*``)."""
        sim = simulate(self.plan, self.newest_profile(), self.cluster())
        predicted = (chunk_frame(sim, breakdown(sim), "predicted_") if chunks else
                     breakdown_frame(breakdown(sim), "predicted_"))
        keys = ["stage", "chunk"] if chunks else "stage"
        return self.metrics.breakdown(last, chunks).merge(predicted, on=keys, how="outer")

    def newest_profile(self) -> ModelProfile:
        """The last profile measured (``profile()``, a replan), without asking the workers unless none was."""
        return self._profiles.newest or self.profile()

    def memory(self, ask: bool = True) -> Any:
        """A DataFrame with a row per worker (``stage``, ``shard``, ``replica``; a pipeline of whole devices has one
        per stage): ``predicted_peak`` (the cost model's for that rank, for the plan in force), ``allocated_peak``
        (what the allocator held, newest measurement; ``allocated_at`` its iteration), ``error`` (allocated over
        predicted, minus 1), ``counted_peak`` (the ledger's count), ``static`` and ``activations`` as predicted, and
        the ``budget``. Measured columns are empty until the workers have measured. ``ask=False`` asks the workers
        for nothing: the prediction uses the profile in hand, and is None before one was measured."""
        return self._memory.frame(ask)

    def _layers_by_stage(self, timeout: float | None = None) -> list[list[int]]:  # processes.layers()
        return [sorted(m.index for m in answer.layers) for answer in self._layers(False, timeout)]

    def _microbatch_size(self) -> int:
        """Samples per micro-batch in the latest iteration (0 before the first): what a profile is measured at."""
        return self.metrics.microbatch_size(self._ranks.replicas)

    def evaluate(self, data: Any = None, batches: int = 1, timeout: float | None = None) -> float:
        """The mean loss of a forward-only pass over ``batches`` batches of ``data`` (like ``launch``'s data: a
        function of the batch index, an iterable, a bundled example name or 'package.module:attribute'; default: the
        job's ``eval_data``, else its training data from its first batch), with the model in eval mode. It runs at
        the next iteration boundary, between two training iterations, and changes nothing of training's state."""
        self._check()
        return evaluate(self._requests, self._job_dir, data, batches, timeout)

    # --- out of the lab and into it (control/outward.py) ------------------------------------------------------------
    def state_dict(self, timeout: float | None = None) -> Any:
        """The trained model as ``model.state_dict()`` has it, gathered from every stage: the same keys in the same
        order (a tied weight under each of its names, one tensor; non-persistent buffers left out), so
        ``model.load_state_dict(session.state_dict(), strict=True)`` loads into a fresh build of the model."""
        return self._outward.state_dict(timeout)

    def export(self, path: str | Path, *, model: Any = None, timeout: float | None = None) -> Path:
        """Write the trained model where ``path`` says, in the form its library loads: a transformers model as a
        folder ``from_pretrained(path)`` reads, any other as a ``torch.save``d state dict. It loads the weights into
        a fresh build of ``model`` (default: the one this session trains), so this process imports torch."""
        return self._outward.export(path, model if model is not None else self._model, timeout)

    def export_plan(self, path: str | Path, *, plan: Plan | None = None, microbatch_size: int | None = None) -> Path:
        """Write the export bundle of the plan in force (or ``plan``) to the directory ``path``: ``pipeline.json``
        (torch stages over the model's own module names), ``schedule.csv`` (the exact order, for torch's
        ``_PipelineScheduleRuntime``), torchtitan and Megatron-LM settings and a README with what the lab measured
        and predicts for it (``wire/bundle_files.py``). ``vpipe_lab.export.torch_pipeline`` trains it on torch."""
        return self._outward.export_plan(path, plan, microbatch_size or self._microbatch_size())

    def import_plan(self, source: Any, *, apply: bool = False, **kw: Any) -> Plan:
        """A production config as a plan over this model's units (``control/changes/interop.read``: a torchtitan
        TOML or ``[parallelism]`` dict, a Megatron-LM layout string, module lists per stage, an export bundle);
        ``apply`` runs it from the next iteration (``apply(plan)``)."""
        return self._outward.import_plan(source, apply, **kw)

    # --- changing the running job (control/changes/live.py) -----------------------------------------------------------------
    def change(self, change: Change, *, force: bool = False, checkpoint: bool = True,
               timeout: float | None = None) -> Applied:
        """Make ``change`` (``core.change.Change``) from the next iteration boundary, migrating layers live; returns
        what was applied (``Applied``). PlanError or InfeasiblePlan (over a budget, unless ``force``) change nothing;
        ``checkpoint`` saves the state before layers move (``Live.change``). Every door to a live change comes here."""
        return self._live.change(change, force=force, checkpoint=checkpoint, timeout=timeout)

    def apply(self, plan: Plan, *, force: bool = False, checkpoint: bool = True, timeout: float | None = None,
              source: str = "api") -> int:
        """Run ``plan`` from the next iteration boundary (``change(Change.to(plan, source))``); returns that
        iteration. ``source`` is who asked, as ``history`` shows it."""
        return self.change(Change.to(plan, source), force=force, checkpoint=checkpoint, timeout=timeout).iteration

    def set_partition(self, boundaries: Sequence[int], **kw: Any) -> int:
        """Move the stage boundaries (layers migrate live); returns the iteration it takes effect."""
        return self.change(Change.of(boundaries=boundaries), **kw).iteration

    def set_policy(self, policies: Mapping[int, Policy | str], **kw: Any) -> int:
        """Change layers' keep/swap/recompute policies, e.g. ``{3: "swap", 4: "recompute"}``."""
        return self.change(Change.of(policies=dict(policies)), **kw).iteration

    def save(self, path: str | Path, *, keep: int | None = None, timeout: float | None = None) -> Path:
        """Write parameters, optimizer state, plan and iteration at the next iteration boundary, as a new version
        of the checkpoint at ``path``: a torch.distributed.checkpoint (DCP) directory keyed by the model's own
        ``state_dict()`` names (optimizer state flattened by parameter name, as torchtitan saves it), checksummed,
        with a manifest, switched to atomically: a crash during the save leaves the previous version intact. ``keep``
        keeps only the newest versions. Returns the version's directory: ``dcp.load(model.state_dict(),
        checkpoint_id=...)`` reads it into a plain model; ``launch(..., resume=path)`` restores the newest onto any
        partition, stage count or schedule."""
        return self._live.save(path, keep=keep, timeout=timeout)

    def set_model(self, factory: Callable[[], Any], *, plan: Plan | None = None,
                  mapping: Mapping[int, int | None] | None = None, timeout: float | None = None) -> int:
        """Switch to the model ``factory()`` builds, from the next iteration (see ``Live.set_model``)."""
        at = self._live.set_model(factory, plan=plan, mapping=mapping, timeout=timeout)
        self._model = factory
        return at

    def replan(self, method: str = "vpipe", *, apply: bool = False, cluster: Cluster | None = None,
               profile: ModelProfile | None = None, choose_microbatches: bool = False, schedule: str | None = None
               ) -> Replan:
        """Profile the running model, plan it from the current plan, and report the predicted gain and the moves;
        ``apply=True`` also applies the new plan (if it differs). ``choose_microbatches`` lets the planner choose
        the number of micro-batches, ``schedule`` ("auto" or a name) the schedule too (see ``Live.replan``)."""
        return self._live.replan(method, apply=apply, cluster=cluster, profile=profile,
                                 choose_microbatches=choose_microbatches, schedule=schedule)

    def auto_replan(self, enabled: bool = True, **options: Any) -> AutoReplanner | None:
        """Let vPipe replan on its own (periodically, on drift, on low memory headroom) and apply a new plan only
        when its predicted gain outweighs the migration; returns the replanner (its ``decisions`` list)."""
        if self._autoplan is not None:
            self._autoplan.stop()
            self._autoplan = None
        self._autoplan = AutoReplanner(self, publish=self._events.publish, **options) if enabled else None
        return self._autoplan

    # --- the end ---------------------------------------------------------------------------------------------------
    def detach(self) -> None:
        """Let go of an attached job without stopping it (``attach`` again any time). Idempotent."""
        if self.closed:
            return
        if self._launcher is not None:
            raise RuntimeError("this session started its workers itself: stop() it; only attached sessions detach")
        self._end()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the workers (gracefully, then SIGTERM, then SIGKILL) and release everything; returns once every
        worker and whatever it started has exited (``remaining()`` is empty). Idempotent."""
        if self.closed:
            return
        self._monitor.expect_exits()
        if self._autoplan is not None:
            self._autoplan.stop()
        if self._launcher is not None:
            if self.failure is None and self._launcher.alive():
                try:
                    self._requests.send(Stop())
                except Exception:  # the hub may already be gone; the signals below still work
                    pass
                self._launcher.wait(timeout / 2)
            # the job directory goes with the workers (a failure's recovery checkpoint in it stays)
            self._launcher.terminate(timeout=timeout / 2, keep=self.failure.checkpoint if self.failure else None)
        elif self.failure is None:  # attached: ask rank 0 to end the job, and wait for its acknowledgement
            try:
                self._requests.command(Stop(), timeout=timeout)
            except Exception as exc:  # the job may be gone already; detaching is all that is left
                log.warning("the attached job did not acknowledge stop: %s", exc)
        self._end()

    def _end(self) -> None:
        if self._autoplan is not None:
            self._autoplan.stop()
        self._monitor.close()
        self._hub.close()
        self._logger.close()
        if self._runlog is not None:
            self._runlog.close()
        self._events.emit({"type": "closed", "status": self.status})  # views freeze at their last state

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        plan = self._state.plan.describe() if self._state.plan else "?"
        eager = f", {len(self.eager)} units run in part eagerly" if self.eager else ""
        return (f"<vpipe_lab.Session {self.status}: {self._ranks.stages} stages, iteration {self._state.iteration}, "
                f"plan {plan}{eager}>")
