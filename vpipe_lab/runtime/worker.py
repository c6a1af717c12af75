"""A stage worker: ``python -m vpipe_lab.runtime.worker --config job.json --rank R`` (the process around it is
``runtime/process.py``).

At every iteration boundary rank 0 broadcasts the controller's pending commands to all ranks (as JSON), so a change
takes effect at the same iteration everywhere. Each rank reports its spans, memory and loss to the controller after
every iteration; any exception is reported with the stage and its traceback before the process exits.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

import torch

from vpipe_lab.control import protocol as P
from vpipe_lab.control.channel import Link
from vpipe_lab.core.model import Plan, Policy
from vpipe_lab.core.partition import uniform
from vpipe_lab.core.timeline import KINDS
from vpipe_lab.runtime import build, profiler
from vpipe_lab.runtime.batches import Source, batch_size, describe, rebuild, split
from vpipe_lab.runtime.capture import Chain, build_model, capture, to_meta
from vpipe_lab.runtime.comm import TAG_TARGET, Peer
from vpipe_lab.runtime.device import Clock, select
from vpipe_lab.runtime.evaluate import evaluate
from vpipe_lab.runtime.executor import Executor, IterationResult, default_loss
from vpipe_lab.runtime.jobspec import JobSpec, load_callables, load_data
from vpipe_lab.runtime.precision import LossScale, autocast
from vpipe_lab.runtime.replicas import DataParallel, shard
from vpipe_lab.runtime.stage import Stage
from vpipe_lab.runtime.step import Stepper, StepReport
from vpipe_lab.runtime.tensors import pack_state
from vpipe_lab.runtime.ties import Ties

log = logging.getLogger("vpipe_lab.worker")


@dataclass
class Control:
    """Where this rank stands: the iteration it runs next and what the controller asked for."""

    iteration: int = 0
    target: int | None = 0  # run until this iteration (None: until stopped)
    paused: bool = False
    stopping: bool = False
    plan_version: int = 0
    pending: list[dict[str, Any]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return not self.paused and not self.stopping and (self.target is None or self.iteration < self.target)


class Worker:
    def __init__(self, spec: JobSpec, rank: int, world: int, link: Link, local_rank: int, local_world: int) -> None:
        # ``rank``/``world`` arrive for the whole job (stages x replicas); from here on ``rank`` is this worker's
        # stage and ``world`` the pipeline's stage count, and ``replica`` says which copy of the pipeline it is in.
        stages = spec.stages
        if world != stages * spec.replicas:
            raise ValueError(f"the job has {world} ranks but {stages} stages x {spec.replicas} replicas")
        self.global_rank, self.leader = rank, rank == 0  # global rank 0 talks to the controller for everyone
        self.replica, self.replicas = divmod(rank, stages)[0], spec.replicas
        rank, world = rank % stages, stages
        self.spec, self.rank, self.world, self.link = spec, rank, world, link
        self.last = rank == world - 1
        self.placement = select(spec.device, local_rank, local_world)
        self.clock = Clock(0.0)
        # Unattended (``vpipe-lab worker --iterations N``): train until iteration N without waiting for a client.
        self.ctl = Control(iteration=spec.start_iteration, target=spec.iterations or 0)
        fns = load_callables(spec)
        self.model_fn, self.split = fns.model, fns.split
        self.eval_data, self.train_data = fns.eval_data, fns.data
        self.loss_fn = fns.loss or default_loss
        self.peer = Peer(self.global_rank, world * self.replicas,
                         self.placement.device if self.placement.is_cuda else torch.device("cpu"), spec.timeout_s,
                         base=self.replica * world, replicas=self.replicas)
        self.source = Source(fns.data, spec.start_iteration) if rank == 0 else None
        self.chain, self.plan = self._build()
        self.names = list(self.chain.names)
        if fns.optimizer is None and self.leader:
            log.warning("no optimizer was given: the parameters will not change; pass optimizer=lambda params: ...")
        self.stage = Stage(self.placement.device, fns.optimizer, spec.seed, fns.lr_scheduler,
                           autocast(spec.precision, self.placement.device))
        mine = set(self.plan.layers_of(rank))
        for i, unit in enumerate(self.chain.units):
            if i in mine:
                self.stage.add_layer(i, unit, self.chain.tensors[i])
            else:
                to_meta(unit, self.chain.tensors[i])  # only the structure stays: a shell for migration
        self.stage.set_policies({i: self.plan.policies[i] for i in self.stage.owned})
        self.stage.probing = not self.chain.graph  # a captured graph runs one micro-batch shape only
        self.ties = Ties(self)
        self.scale = LossScale(spec.precision == "fp16")
        self.data_parallel = DataParallel(self.peer.device, world, self.replicas)
        self.stepper = Stepper(self.stage, self.ties, self.peer, rank, world, spec.clip_grad_norm, self.scale,
                               self.data_parallel)
        self._agreed: str | None = None  # rank 0: the input signature this shape epoch began with
        self.profiling = profiler.ProfileSchedule()
        budget = spec.memory_budget[rank] if spec.memory_budget else None
        self.executor = Executor(rank, world, self.stage, self.peer, self.placement, self.clock, self.loss_fn, budget,
                                 record_spans=spec.telemetry, chain=self.chain)

    def _build(self) -> tuple[Chain, Plan]:
        """The model as units, with real tensors for this stage's units only (see ``runtime/build.py``); a model
        given as an instance was built by the caller and arrives whole, and one that cannot be laid out on the meta
        device is built whole."""
        spec, factory = self.spec, self.model_fn
        meta = order = layout = None
        if callable(factory) and not isinstance(factory, torch.nn.Module):
            try:
                meta, order = build.on_meta(factory, spec.seed)
            except Exception as exc:  # a factory that needs real tensors to build (data-dependent init)
                log.info("the model does not build on the meta device (%s: %s); building it whole",
                         type(exc).__name__, exc)
        model = meta if meta is not None else build_model(factory, spec.seed)
        self.example = self._example(model)
        if meta is not None:
            try:
                layout = capture(meta.train(), rebuild(self.example, device=torch.device("meta"))
                                 if self.example else None, self.split)
            except Exception as exc:  # an op without a meta kernel, say; the real capture decides
                log.info("cannot lay the model out on the meta device (%s); building it whole", exc)
                model = build_model(factory, spec.seed)
        if layout is None:
            chain = capture(model, rebuild(self.example) if self.example else None, self.split)
            return chain, self._initial_plan(chain)
        assert meta is not None and order is not None
        plan = self._initial_plan(layout)
        mine = [layout.tensors[i] for i in plan.layers_of(self.rank)]
        keep = {c for t in mine for _, c in t.params + t.buffers}
        model = build.owned_only(factory, spec.seed, build.registered_names(meta, order), keep).train()
        chain = capture(model, rebuild(self.example) if self.example else None, self.split)
        if chain.signature() != layout.signature():
            raise RuntimeError("the model is cut differently on the meta device and for real; build it without "
                               "device-dependent code")
        return chain, plan

    def _example(self, model: torch.nn.Module) -> dict[str, Any] | None:
        """Rank 0 describes one micro-batch of the first batch's inputs to every rank, which captures the model
        on zeros of those shapes (only rank 0 reads data). An nn.Sequential needs no example."""
        if isinstance(model, torch.nn.Sequential) and self.split is None:
            return None
        desc = None
        if self.rank == 0:
            assert self.source is not None
            inputs, _ = self.source.peek(self.ctl.iteration)
            inputs = shard(inputs, self.replica, self.replicas, "inputs")
            desc, _ = describe(split(inputs, self.spec.microbatches, "inputs")[0])
        return self.peer.broadcast_json(desc) if self.world > 1 else desc

    def _check_same_chain(self, chain: Chain) -> None:
        """Every rank captured the model on its own; they must agree on the units and what crosses between them."""
        mine = chain.signature()
        if self.world > 1 and self.peer.broadcast_json(mine) != mine:
            raise RuntimeError(f"stage {self.rank} cut the model differently from stage 0: the model factory must "
                               "build the same model on every rank (seeded, no rank-dependent code)")

    def _initial_plan(self, chain: Chain) -> Plan:
        """The plan to start with, checked against the units every rank agrees on."""
        self._check_same_chain(chain)
        self.num_layers = len(chain)
        if self.num_layers < self.world:
            raise ValueError(f"the model has {self.num_layers} partition units ({', '.join(chain.names)}) but the "
                             f"pipeline has {self.world} stages: every stage needs at least one unit; use at most "
                             f"{self.num_layers} stages, or more split points")
        if self.spec.plan is not None:
            plan = Plan.from_dict(self.spec.plan)
            return plan.validate(self.num_layers, self.world)
        return Plan(uniform(self.num_layers, self.world), (Policy.KEEP,) * self.num_layers, self.spec.microbatches,
                    self.spec.schedule).validate(self.num_layers, self.world)

    # --- the control loop -----------------------------------------------------------------------------------------
    def send(self, kind: str, body: dict[str, Any], buffers: list[Any] | None = None) -> None:
        self.link.send(P.Message(kind, body=body, buffers=buffers or []))

    def boundary(self, violated: bool) -> tuple[list[dict[str, Any]], bool]:
        """Every rank learns here, at the same iteration, whether any rank went over its budget in the iteration
        just run and which commands to apply. One all-reduce in the common case (no commands); the commands' JSON
        follows as a broadcast only when rank 0 has some."""
        blob = b""
        changed = float(self._input_changed()) if self.rank == 0 else 0.0
        if self.leader:
            cmds = []
            wait = 0.0 if self.ctl.active else 0.2
            deadline = time.monotonic() + wait
            while True:
                try:
                    msg = self.link.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                    cmds.append({"type": msg.type, **msg.body})
                    deadline = 0.0  # got something: drain the rest without waiting
                except Empty:
                    break
            blob = json.dumps(cmds).encode() if cmds else b""
        flag, size, changed = self.peer.all_max([1.0 if violated else 0.0, float(len(blob)), changed])
        commands: list[dict[str, Any]] = []
        if size > 0:
            commands = self.peer.broadcast_json(json.loads(blob) if self.leader else None)
        if size > 0 or changed > 0:
            # A new shape epoch on every rank at once: commands may change the plan or the run state, and new input
            # shapes change what crosses every boundary (see runtime/comm.py).
            self.peer.reset_shapes()
            self._agreed = None
            if changed > 0:
                self.profile_soon()
        return commands, flag > 0

    def profile_soon(self) -> None:
        """Measure every layer again in the next profiling iterations: after a plan change, on new input shapes and
        when the controller resets the profile (start-up asks too)."""
        self.profiling.soon()

    def _input_changed(self) -> bool:
        """Rank 0: whether the next iteration's batch has other shapes than the one the shape epoch began with
        (it is read now, and the iteration gets the same batch)."""
        if not self.ctl.active or self._agreed is None:
            return False
        assert self.source is not None
        return self._signature(*self.source.peek(self.ctl.iteration)) != self._agreed

    @staticmethod
    def _signature(inputs: Any, targets: Any) -> str:
        return json.dumps([describe(inputs)[0], describe(targets)[0]])

    def ack(self, cmd: dict[str, Any], **extra: Any) -> None:
        if self.leader:
            self.send(P.ACK, {"id": cmd.get("id"), "type": cmd["type"], "iteration": self.ctl.iteration, **extra})

    def apply(self, cmd: dict[str, Any]) -> None:
        kind = cmd["type"]
        if kind == P.RUN:
            n = cmd.get("iterations")
            self.ctl.target = None if n is None else self.ctl.iteration + int(n)
            self.ctl.paused = False
            self.ack(cmd, target=self.ctl.target)
            if self.leader:
                self.send(P.CURRENT, {"running": self.ctl.target is None, "target": self.ctl.target})
        elif kind == P.PAUSE:
            self.ctl.paused = True
            self.ack(cmd)
        elif kind == P.RESUME:
            self.ctl.paused = False
            self.ack(cmd)
        elif kind == P.STOP:
            self.ctl.stopping = True
            self.ack(cmd)
        elif kind == P.PROFILE:
            costs = profiler.layer_costs(self.stage, dict(enumerate(self.names)))
            if self.replica == 0:  # every replica measures the same layers; the first one answers
                self.send(P.LAYERS, {"id": cmd.get("id"), "rank": self.rank, "layers": costs})
            if cmd.get("reset"):
                self.stage.reset_stats()
                self.profile_soon()
        elif kind == P.STATE and self.replica == 0:  # the replicas hold the same state
            meta, buffers = pack_state(self.stage)
            self.send(P.TENSORS, {"id": cmd.get("id"), "rank": self.rank, "tensors": meta}, buffers)
        elif kind == P.STATE:
            pass
        elif kind == P.PING:
            self.ack(cmd)
        elif kind == P.TELEMETRY:
            self.executor.record_spans = bool(cmd.get("spans", True))
            self.ack(cmd)
        elif kind == P.EVAL:
            ref, data, problem = str(cmd["data"]), None, ""
            if self.rank == 0:  # only the first stage reads data
                own = self.eval_data if self.eval_data is not None else self.train_data
                try:
                    data = own if ref == "job:" else load_data(ref)
                except ValueError as exc:  # bad input from the client: say so, change nothing, train on
                    problem = str(exc)
            if self.peer.all_max([1.0 if problem else 0.0])[0] > 0:
                if self.leader:
                    self.send(P.EVALUATED, {"id": cmd.get("id"), "rank": self.rank, "error": problem})
                return
            self.evaluation(data, int(cmd.get("batches", 1)), cmd.get("id"))
        else:
            self.handle_extra(cmd)

    def handle_extra(self, cmd: dict[str, Any]) -> None:
        raise ValueError(f"rank {self.rank} got an unknown command {cmd['type']!r}")

    def evaluation(self, data: Any, batches: int, cid: Any = None) -> None:
        """Every rank: an evaluation pass at this boundary; the last stage reports its mean loss."""
        found = evaluate(self, data, batches)
        if found is not None and self.replica == 0:  # every replica evaluates the same batches
            self.send(P.EVALUATED, {"id": cid, "rank": self.rank, "iteration": self.ctl.iteration, **found})

    def after_iteration(self) -> None:
        """Every rank, after an iteration was taken: the periodic evaluation (subclasses add checkpoints)."""
        every = self.spec.eval_every
        if every and self.ctl.iteration % every == 0:
            own = self.eval_data if self.eval_data is not None else self.train_data
            self.evaluation(own if self.rank == 0 else None, self.spec.eval_batches)

    def unattended_done(self) -> bool:
        """An unattended job ends once it has trained the iterations it was started for (nobody will stop it)."""
        return self.spec.iterations is not None and self.ctl.iteration >= self.spec.iterations and not self.ctl.paused

    def loop(self) -> None:
        result: IterationResult | None = None
        memory: dict[str, Any] = {}
        stepped: StepReport | None = None
        while True:
            commands, failed = self.boundary(result is not None and result.violation is not None)
            if result is not None:
                if self.finish(result, failed, memory, stepped):
                    self.after_iteration()
                result = None
            for cmd in commands:
                self.apply(cmd)
            if self.ctl.stopping:
                return
            if self.unattended_done():
                self.finish_unattended()
                return
            if self.ctl.active:
                self.executor.loss_multiplier = self.scale.scale
                result = self.iteration()
                memory = self.memory_snapshot()
                # Without memory budgets no stage can veto the step, so each stage steps as soon as its own
                # backward is done (the last stage while the first still runs its last backward), as plain
                # pipelines do, instead of after the boundary's agreement.
                stepped = self.stepper.step(result.iteration) if self.spec.memory_budget is None else None

    def finish_unattended(self) -> None:
        """What an unattended job does when it is done (subclasses save a last checkpoint)."""
        log.info("trained to iteration %d; the unattended job ends", self.ctl.iteration)

    def iteration(self) -> IterationResult:
        """Rank 0 reads the batch and sends the targets to the last stage, which alone needs them."""
        it = self.ctl.iteration
        batch: tuple[Any, Any] | None = None
        self.samples = None
        if self.rank == 0:
            assert self.source is not None
            inputs, targets = self.source.get(it)
            inputs = shard(inputs, self.replica, self.replicas, "inputs")
            targets = shard(targets, self.replica, self.replicas, "targets")
            self.samples = batch_size(inputs)
            if self._agreed is None:
                self._agreed = self._signature(inputs, targets)
            if not self.last:
                self.peer.post_send(targets, self.world - 1, TAG_TARGET, agreed=True, exact=True)
            batch = (inputs, targets)
        elif self.last:
            batch = (None, self.peer.wait(self.peer.post_recv(0, TAG_TARGET, agreed=True)))
        self.stage.mb_offset = self.replica * self.plan.microbatches
        profile, drop = self.profiling.next(it)
        if drop:
            self.stage.reset_stats()
        return self.executor.run(it, self.plan, batch, profile=profile)

    def finish(self, result: IterationResult, failed: bool, memory: dict[str, Any], stepped: StepReport | None
               ) -> bool:
        """Step (unless done already), or (when any rank went over its budget) drop the iteration on every rank and
        pause; whether the iteration was taken."""
        if failed:
            # No parameter or optimizer state changes; the same iteration runs again after resume.
            self.stage.discard()
            self.ctl.paused = True
            if result.violation is not None:
                v = result.violation
                self.send(P.ERROR, {"kind": "budget", "stage": self.rank, "iteration": result.iteration,
                                    "used": v.used_bytes, "budget": v.budget_bytes, "layers": v.layers,
                                    "memory": memory})
            return False
        if stepped is None:
            stepped = self.stepper.step(result.iteration)
        self.ctl.iteration += 1
        self.report(result, memory, stepped)
        return True

    def memory_snapshot(self) -> dict[str, Any]:
        static = self.stage.static_bytes()
        ledger = self.stage.ledger
        snap: dict[str, Any] = {**static, "activations": ledger.peak, "resident": ledger.resident_peak,
                                "host": ledger.host_peak,
                                "peak": sum(static.values()) + ledger.peak,
                                "budget": self.executor.budget}
        if self.placement.is_cuda:
            snap["cuda_allocated"] = torch.cuda.memory_allocated(self.placement.device)
            snap["cuda_peak"] = torch.cuda.max_memory_allocated(self.placement.device)
            torch.cuda.reset_peak_memory_stats(self.placement.device)
        return snap

    def report(self, result: IterationResult, memory: dict[str, Any], step: StepReport) -> None:
        spans = [[KINDS.index(k), mb, -1 if layer is None else layer, s, e] for k, mb, layer, s, e in result.spans]
        self.send(P.ITERATION, {
            "iteration": result.iteration, "stage": self.rank, "start": result.start_s, "end": result.end_s,
            "losses": result.losses, "plan_version": self.ctl.plan_version, "memory": memory, "spans": spans,
            "microbatches": self.plan.microbatches, "samples": self.samples, **step.to_dict(),
            "replica": self.replica,
        })


if __name__ == "__main__":  # what launch() starts: python -m vpipe_lab.runtime.worker
    from vpipe_lab.runtime.process import main

    sys.exit(main())
