"""What each controller command does on every rank (the command bodies are in ``wire/commands.py``): ``Replies``,
the acknowledgements and run-state commands both engines answer alike (``runtime/worker.py``'s ``Worker`` and
``runtime/torch_pp/engine.py``'s ``TorchWorker``), and ``WorkerCommands``, the lab engine's handlers and its live
reconfiguration; each a collaborator of its worker, which it reads through a Protocol.

Every rank runs the same handler at the same iteration boundary (rank 0 broadcast the commands); rank 0 alone
acknowledges, and commands that gather data are answered by each stage of the first replica.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

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


class ReplyHost(Protocol):
    """What ``Replies`` reads of a worker of either engine."""

    leader: bool
    ctl: Control
    plan: Plan
    chain: Chain
    names: list[str]
    link: Link

    def send(self, body: Body) -> None:
        """Send ``body`` to the controller."""

    def save(self, root: Path, name: str | None = None, keep: int | None = None) -> str | None:
        """A new checkpoint version under ``root``; None, or why it failed."""


class Replies:
    """The commands waiting at rank 0, acknowledgements, the job as it is now, and the commands both engines answer
    alike (run, pause, resume, stop, save) for one worker (its ``host``)."""

    def __init__(self, host: ReplyHost) -> None:
        self.host = host

    def pending(self, wait_s: float) -> list[dict[str, Any]]:
        """Rank 0: the controller's commands that arrived since the last boundary, checked (a malformed one is
        logged and dropped: the controller speaks the same typed protocol, so it can only come from another
        version or a faulty client)."""
        docs = []
        for msg in self.host.link.drain(wait_s):
            try:
                docs.append(decode(msg).to_doc())
            except ProtocolError as exc:
                log.error("dropped a command: %s", exc)
        return docs

    def ack(self, cmd: C.Command, **extra: Any) -> None:
        if self.host.leader:
            self.host.send(E.Ack(cmd.id, cmd.TYPE, self.host.ctl.iteration, **extra))

    def current(self) -> None:
        """Rank 0: the job as it is now, for a broker's attaching clients (see runtime/broker.py)."""
        h = self.host
        if h.leader:
            h.send(E.Current(h.plan.to_dict(), h.ctl.plan_version, h.names, h.ctl.iteration, h.ctl.target is None,
                             h.ctl.target, h.chain.infos(), h.ctl.paused))

    def run(self, cmd: C.Run) -> None:
        ctl, n = self.host.ctl, cmd.iterations
        ctl.target = None if n is None else ctl.iteration + n
        ctl.paused = False
        self.ack(cmd, target=ctl.target)
        self.current()

    def run_state(self, cmd: C.Pause | C.Resume | C.Stop) -> None:
        self.host.ctl.take(cmd.TYPE)
        self.ack(cmd)
        self.current()

    def save(self, cmd: C.Save) -> None:
        problem = self.host.save(Path(cmd.path), cmd.name, cmd.keep)
        self.ack(cmd, path=cmd.path, ok=problem is None, error=problem)


class RankHost(ReplyHost, Protocol):
    """What a rank's handlers read of a worker of either engine beyond its replies: the job, this rank's place in
    it, its peers and the model as it stands (``TorchState`` reads it too)."""

    spec: JobSpec
    index: int
    world: int
    place: Place
    num_layers: int
    model_version: int
    peer: Peer


class CommandHost(RankHost, Protocol):
    """What the lab engine's handlers read of its ``Worker``: beside a rank's, the user's model and data, its stage
    and executor (the plan in force is replaced by a change, so read when asked)."""

    replica: int
    model_fn: Any  # the user's model: a factory, an instance or a bundled name
    split: Any  # the user's split function, or None
    train_data: Any  # the user's data: a callable of the iteration or an iterable
    eval_data: Any
    stage: Stage
    executor: Executor
    shapes: ShapeEpochs
    migration: Migration

    def profile_soon(self) -> None:
        """Measure the next iterations' layers afresh."""

    def evaluation(self, data: Any, batches: int, cid: int = 0) -> None:
        """An evaluation pass over ``batches`` of ``data``."""


class WorkerCommands:
    """The lab engine's handlers of the commands that read or change its state (profile, state, telemetry, evaluate,
    apply, set_model) for one ``Worker`` (its ``host``); acknowledgements through its ``replies``."""

    def __init__(self, host: CommandHost, replies: Replies) -> None:
        self.host, self.replies = host, replies

    def table(self) -> dict[type[Body], Callable[[Any], None]]:
        """The one command table: what each controller command does on every rank (see wire/commands.py)."""
        r = self.replies
        return {C.Run: r.run, C.Pause: r.run_state, C.Resume: r.run_state, C.Stop: r.run_state, C.Ping: r.ack,
                C.Profile: self.profile, C.State: self.state, C.Telemetry: self.telemetry, C.Evaluate: self.evaluate,
                C.Save: r.save, C.Apply: self.apply_plan, C.SetModel: self.set_model}

    # --- the commands ---------------------------------------------------------------------------------------------
    def profile(self, cmd: C.Profile) -> None:
        h = self.host
        costs = profiler.layer_costs(h.stage, dict(enumerate(h.names)), h.chain.shared_params())
        if h.replica == 0:  # every replica measures the same layers; the first one answers
            h.send(E.Layers(cmd.id, h.index, costs))
        if cmd.reset:
            h.stage.reset_stats()
            h.profile_soon()

    def state(self, cmd: C.State) -> None:
        h = self.host
        # the replicas hold the same state; a sharded stage's shards gather each tensor whole together
        if h.replica == 0 or h.stage.shards is not None:
            meta, buffers = pack_state(h.stage, h.chain)
            if h.replica == 0:
                h.send(E.Tensors(cmd.id, h.index, meta, buffers))

    def telemetry(self, cmd: C.Telemetry) -> None:
        self.host.executor.record_spans = cmd.spans
        self.replies.ack(cmd)

    def evaluate(self, cmd: C.Evaluate) -> None:
        h = self.host
        ref, data, problem = cmd.data, None, ""
        if h.index == 0:  # only the first stage reads data
            own = h.eval_data if h.eval_data is not None else h.train_data
            try:
                data = own if ref == "job:" else load_data(ref, job_dir(h.spec))
            except ValueError as exc:  # bad input from the client: say so, change nothing, train on
                problem = str(exc)
        if h.peer.all_max([1.0 if problem else 0.0])[0] > 0:
            if h.leader:
                h.send(E.Evaluated(h.index, cmd.id, h.ctl.iteration, error=problem))
            return
        h.evaluation(data, cmd.batches, cmd.id)

    def apply_plan(self, cmd: C.Apply) -> None:
        h = self.host
        plan = agreed_plan(cmd.plan, cmd.schedules, h.num_layers, h.world, h.peer.all_max, job_dir(h.spec))
        if not isinstance(plan, str) and (plan.shards, plan.replicas) != (h.place.shards, h.place.replicas):
            plan = (f"the plan is for {plan.shards} shard(s) x {plan.replicas} replica(s) of each stage and the job "
                    f"runs {h.place.shards} x {h.place.replicas}: a new mesh needs a restart (save, then resume "
                    "on the new mesh)")  # every rank reads the same plan: all refuse together
        if isinstance(plan, str):
            return self.replies.ack(cmd, ok=False, error=plan)
        self.ack_reconfigured(cmd, self.reconfigure(plan, {j: j for j in range(h.num_layers)}, None, cmd))

    def set_model(self, cmd: C.SetModel) -> None:
        h = self.host
        factory = load_data(f"file:{cmd.path}", job_dir(h.spec))  # the controller wrote it into the job directory
        try:  # every rank reaches the same verdict: a model that cannot run here changes nothing, training goes on
            chain, sources, plan = new_model(factory, h.spec.settings.seed + 1_000_003 * (h.model_version + 1),
                                             h.chain, h.plan, h.world, cmd.mapping, cmd.plan, h.shapes.example, h.split)
        except Exception as exc:
            return self.replies.ack(cmd, ok=False, error=f"{type(exc).__name__}: {exc}")
        result = self.reconfigure(plan, sources, chain, cmd)
        if result.ok:
            h.model_fn, h.model_version = factory, h.model_version + 1
            h.shapes.recaptures.reset(factory)
        self.ack_reconfigured(cmd, result, names=h.names, plan=h.plan.to_dict(),
                              mapping={str(j): i for j, i in sources.items()}, units=h.chain.infos())

    def ack_reconfigured(self, cmd: C.Apply | C.SetModel, result: Reconfigured, names: list[str] | None = None,
                         plan: dict[str, Any] | None = None, mapping: dict[str, int | None] | None = None,
                         units: list[dict[str, Any]] | None = None) -> None:
        """Rank 0 acknowledges a plan or model change with what it did (and, for a model, the new model's unit
        ``names``, ``plan``, ``mapping`` new -> old and ``units``)."""
        h = self.host
        if h.leader:
            h.send(E.Ack(cmd.id, cmd.TYPE, h.ctl.iteration, ok=result.ok, error=result.error,
                         refused=result.refused, moved_bytes=result.moved_bytes, pause_s=result.pause_s,
                         version=result.version, layers=result.layers, names=names, plan=plan, mapping=mapping,
                         units=units))

    def reconfigure(self, plan: Plan, sources: dict[int, int | None], chain: Any, cmd: C.Apply | C.SetModel
                    ) -> Reconfigured:
        """Live migration to ``plan`` (``runtime/migrate.py``); on success this rank takes the new plan and chain."""
        h = self.host
        version = cmd.version if cmd.version is not None else h.ctl.plan_version + 1
        out = h.migration.reconfigure(h.plan, h.chain, plan, sources, chain, cmd.checkpoint, version,
                                      h.ctl.iteration, h.executor.budget)
        if not out.result.ok:
            return out.result
        h.profile_soon()
        h.chain = h.executor.chain = out.chain
        h.num_layers, h.names = len(out.chain), list(out.chain.names)
        h.plan, h.ctl.plan_version = plan, version
        if h.stage.shards is not None:  # when this stage gathers and reduces, from the next iteration
            h.stage.shards.set_sharding(plan.sharding_of(h.index))
        self.replies.current()  # an attached client learns the plan in force from this
        return out.result
