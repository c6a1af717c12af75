"""What each controller command does on every rank (the command bodies are in ``wire/commands.py``): the worker's
command handlers, acknowledgements and live reconfiguration, mixed into ``runtime/worker.py``'s ``Worker``.

Every rank runs the same handler at the same iteration boundary (rank 0 broadcast the commands); rank 0 alone
acknowledges, and commands that gather data are answered by each stage of the first replica.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vpipe_lab.core.plan import Plan
from vpipe_lab.runtime.engine import profiler
from vpipe_lab.runtime.engine.comm import Peer
from vpipe_lab.runtime.engine.executor import Executor
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.migrate import Migration, Reconfigured, new_model
from vpipe_lab.runtime.model.callables import agreed_plan, job_dir, load_data
from vpipe_lab.runtime.model.capture import Chain
from vpipe_lab.runtime.progress import Control
from vpipe_lab.runtime.shape_epochs import ShapeEpochs
from vpipe_lab.runtime.trained_tensors import pack_state
from vpipe_lab.runtime.training.place import Place
from vpipe_lab.wire import commands as C
from vpipe_lab.wire import events as E
from vpipe_lab.wire.channel import Link
from vpipe_lab.wire.codec import Body, decode
from vpipe_lab.wire.jobspec import JobSpec
from vpipe_lab.wire.protocol import ProtocolError

log = logging.getLogger("vpipe_lab.worker")


class WorkerCommands:
    """The command handlers of a ``Worker`` (which owns the state named below)."""

    spec: JobSpec
    index: int
    world: int
    replica: int
    place: Place
    leader: bool
    ctl: Control
    plan: Plan
    chain: Chain
    names: list[str]
    num_layers: int
    model_version: int
    model_fn: Any
    split: Any
    train_data: Any
    eval_data: Any
    stage: Stage
    peer: Peer
    executor: Executor
    shapes: ShapeEpochs
    migration: Migration
    commands: dict[type[Body], Callable[[Any], None]]
    link: Link

    send: Callable[[Body], None]
    profile_soon: Callable[[], None]
    save: Callable[..., str | None]
    evaluation: Callable[..., None]

    def _pending(self, wait_s: float) -> list[dict[str, Any]]:
        """Rank 0: the controller's commands that arrived since the last boundary, checked (a malformed one is
        logged and dropped: the controller speaks the same typed protocol, so it can only come from another
        version or a faulty client)."""
        docs = []
        for msg in self.link.drain(wait_s):
            try:
                docs.append(decode(msg).to_doc())
            except ProtocolError as exc:
                log.error("dropped a command: %s", exc)
        return docs

    def ack(self, cmd: C.Command, **extra: Any) -> None:
        if self.leader:
            self.send(E.Ack(cmd.id, cmd.TYPE, self.ctl.iteration, **extra))

    def dispatch(self, cmd: C.Command) -> None:
        handler = self.commands.get(type(cmd))
        if handler is None:
            raise ValueError(f"stage {self.index} got {type(cmd).__name__} ({cmd.TYPE!r}), which is not a command")
        handler(cmd)

    def current(self) -> None:
        """Rank 0: the job as it is now, for a broker's attaching clients (see runtime/broker.py)."""
        if self.leader:
            self.send(E.Current(self.plan.to_dict(), self.ctl.plan_version, self.names, self.ctl.iteration,
                                self.ctl.target is None, self.ctl.target, self.chain.infos(), self.ctl.paused))

    # --- the commands ---------------------------------------------------------------------------------------------
    def _run(self, cmd: C.Run) -> None:
        n = cmd.iterations
        self.ctl.target = None if n is None else self.ctl.iteration + n
        self.ctl.paused = False
        self.ack(cmd, target=self.ctl.target)
        self.current()

    def _run_state(self, cmd: C.Pause | C.Resume | C.Stop) -> None:
        self.ctl.take(cmd.TYPE)
        self.ack(cmd)
        self.current()

    def _profile(self, cmd: C.Profile) -> None:
        costs = profiler.layer_costs(self.stage, dict(enumerate(self.names)), self.chain.shared_params())
        if self.replica == 0:  # every replica measures the same layers; the first one answers
            self.send(E.Layers(cmd.id, self.index, costs))
        if cmd.reset:
            self.stage.reset_stats()
            self.profile_soon()

    def _state(self, cmd: C.State) -> None:
        # the replicas hold the same state; a sharded stage's shards gather each tensor whole together
        if self.replica == 0 or self.stage.shards is not None:
            meta, buffers = pack_state(self.stage, self.chain)
            if self.replica == 0:
                self.send(E.Tensors(cmd.id, self.index, meta, buffers))

    def _telemetry(self, cmd: C.Telemetry) -> None:
        self.executor.record_spans = cmd.spans
        self.ack(cmd)

    def _evaluate(self, cmd: C.Evaluate) -> None:
        ref, data, problem = cmd.data, None, ""
        if self.index == 0:  # only the first stage reads data
            own = self.eval_data if self.eval_data is not None else self.train_data
            try:
                data = own if ref == "job:" else load_data(ref, job_dir(self.spec))
            except ValueError as exc:  # bad input from the client: say so, change nothing, train on
                problem = str(exc)
        if self.peer.all_max([1.0 if problem else 0.0])[0] > 0:
            if self.leader:
                self.send(E.Evaluated(self.index, cmd.id, self.ctl.iteration, error=problem))
            return
        self.evaluation(data, cmd.batches, cmd.id)

    def _save(self, cmd: C.Save) -> None:
        problem = self.save(Path(cmd.path), cmd.name, cmd.keep)
        self.ack(cmd, path=cmd.path, ok=problem is None, error=problem)

    def _apply_plan(self, cmd: C.Apply) -> None:
        plan = agreed_plan(cmd.plan, cmd.schedules, self.num_layers, self.world, self.peer.all_max, job_dir(self.spec))
        if not isinstance(plan, str) and (plan.shards, plan.replicas) != (self.place.shards, self.place.replicas):
            plan = (f"the plan is for {plan.shards} shard(s) x {plan.replicas} replica(s) of each stage and the job "
                    f"runs {self.place.shards} x {self.place.replicas}: a new mesh needs a restart (save, then resume "
                    "on the new mesh)")  # every rank reads the same plan: all refuse together
        if isinstance(plan, str):
            return self.ack(cmd, ok=False, error=plan)
        self.ack_reconfigured(cmd, self.reconfigure(plan, {j: j for j in range(self.num_layers)}, None, cmd))

    def _set_model(self, cmd: C.SetModel) -> None:
        factory = load_data(f"file:{cmd.path}", job_dir(self.spec))  # the controller wrote it into the job directory
        try:  # every rank reaches the same verdict: a model that cannot run here changes nothing, training goes on
            chain, sources, plan = new_model(factory, self.spec.settings.seed + 1_000_003 * (self.model_version + 1),
                                             self.chain, self.plan, self.world, cmd.mapping, cmd.plan,
                                             self.shapes.example, self.split)
        except Exception as exc:
            return self.ack(cmd, ok=False, error=f"{type(exc).__name__}: {exc}")
        result = self.reconfigure(plan, sources, chain, cmd)
        if result.ok:
            self.model_fn, self.model_version = factory, self.model_version + 1
            self.shapes.recaptures.reset(factory)
        self.ack_reconfigured(cmd, result, names=self.names, plan=self.plan.to_dict(),
                              mapping={str(j): i for j, i in sources.items()}, units=self.chain.infos())

    def ack_reconfigured(self, cmd: C.Apply | C.SetModel, result: Reconfigured, names: list[str] | None = None,
                         plan: dict[str, Any] | None = None, mapping: dict[str, int | None] | None = None,
                         units: list[dict[str, Any]] | None = None) -> None:
        """Rank 0 acknowledges a plan or model change with what it did (and, for a model, the new model's unit
        ``names``, ``plan``, ``mapping`` new -> old and ``units``)."""
        if self.leader:
            self.send(E.Ack(cmd.id, cmd.TYPE, self.ctl.iteration, ok=result.ok, error=result.error,
                            refused=result.refused, moved_bytes=result.moved_bytes, pause_s=result.pause_s,
                            version=result.version, layers=result.layers, names=names, plan=plan, mapping=mapping,
                            units=units))

    def reconfigure(self, plan: Plan, sources: dict[int, int | None], chain: Any, cmd: C.Apply | C.SetModel
                    ) -> Reconfigured:
        """Live migration to ``plan`` (``runtime/migrate.py``); on success this rank takes the new plan and chain."""
        version = cmd.version if cmd.version is not None else self.ctl.plan_version + 1
        out = self.migration.reconfigure(self.plan, self.chain, plan, sources, chain, cmd.checkpoint, version,
                                         self.ctl.iteration, self.executor.budget)
        if not out.result.ok:
            return out.result
        self.profile_soon()
        self.chain = self.executor.chain = out.chain
        self.num_layers, self.names = len(out.chain), list(out.chain.names)
        self.plan, self.ctl.plan_version = plan, version
        if self.stage.shards is not None:  # when this stage gathers and reduces, from the next iteration
            self.stage.shards.set_sharding(plan.sharding_of(self.index))
        self.current()  # an attached client learns the plan in force from this
        return out.result
