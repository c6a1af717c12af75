"""A stage worker: one rank's control loop and its command table (the process around it is ``runtime/process.py``,
started as ``python -m vpipe_lab.runtime.process --config job.json --rank R``).

At every iteration boundary rank 0 broadcasts the controller's pending commands to all ranks (as JSON), so a change
takes effect at the same iteration everywhere. Each rank reports its spans, memory and loss to the controller after
every iteration; any exception is reported with the stage and its traceback before the process exits.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vpipe_lab.runtime.build import build_chain, on_meta
from vpipe_lab.runtime.disk.checkpoints import Checkpoints
from vpipe_lab.runtime.disk.snapshots import BatchBuffer, Snapshots
from vpipe_lab.runtime.engine import allocator, profiler, wgrad
from vpipe_lab.runtime.engine.bandwidth import probe_bandwidth, probe_shards, probe_update
from vpipe_lab.runtime.engine.comm import TAG_TARGET, Peer
from vpipe_lab.runtime.engine.device import Clock, select
from vpipe_lab.runtime.engine.executor import Executor, default_loss
from vpipe_lab.runtime.engine.iteration import IterationResult
from vpipe_lab.runtime.engine.shards import Shards
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.heap import Trimmer
from vpipe_lab.runtime.iteration_end import IterationEnd
from vpipe_lab.runtime.migrate import Migration
from vpipe_lab.runtime.model import counting
from vpipe_lab.runtime.model.batches import Source, batch_size, signature, split
from vpipe_lab.runtime.model.callables import load_callables
from vpipe_lab.runtime.model.capture import to_meta
from vpipe_lab.runtime.model.data_checks import BadBatch
from vpipe_lab.runtime.progress import Control
from vpipe_lab.runtime.recapture import Recaptures
from vpipe_lab.runtime.shape_epochs import ShapeEpochs
from vpipe_lab.runtime.training.evaluate import evaluate
from vpipe_lab.runtime.training.place import Place
from vpipe_lab.runtime.training.precision import LossScale, autocast
from vpipe_lab.runtime.training.replicas import DataParallel, shard
from vpipe_lab.runtime.training.step import Stepper, StepReport
from vpipe_lab.runtime.training.ties import Ties
from vpipe_lab.runtime.worker_commands import Replies, WorkerCommands
from vpipe_lab.wire import commands as C
from vpipe_lab.wire import events as E
from vpipe_lab.wire.channel import Link
from vpipe_lab.wire.checkpoint_format import Manifest
from vpipe_lab.wire.codec import Body, from_doc
from vpipe_lab.wire.jobspec import JobSpec
from vpipe_lab.wire.snapshot_format import SnapshotMeta

log = logging.getLogger("vpipe_lab.worker")


def _shell(model_fn: Any, seed: int) -> torch.nn.Module | None:
    """The model without memory (meta device), to read how its own loss counts labels; None if it cannot build so."""
    if isinstance(model_fn, torch.nn.Module):
        return model_fn
    try:
        return on_meta(model_fn, seed)[0]
    except Exception:  # a factory that needs real tensors: its labels are then counted without a shift
        return None


class Worker:
    """One rank of the pipeline: builds its stage, runs the control loop and answers the controller's commands."""

    def __init__(self, spec: JobSpec, rank: int, world: int, link: Link, local_rank: int, local_world: int) -> None:
        # ``rank``/``world`` arrive for the whole job (stages x shards x replicas); ``index`` is this worker's stage in
        # its pipeline, ``world`` (from here on) the pipeline's stage count and ``replica`` which data-parallel copy
        # of the pipeline it runs (a shard of a replica runs a pipeline of its own: ``place`` says which is which).
        stages, shards, replicas = spec.settings.stages, spec.settings.shards, spec.settings.replicas
        if world != stages * shards * replicas:
            raise ValueError(f"the job has {world} ranks but {stages} stages x {shards} shards x {replicas} replicas")
        self.place = Place(rank, stages, shards, replicas)
        self.global_rank, self.leader = rank, rank == 0  # global rank 0 talks to the controller for everyone
        self.replica, self.replicas = self.place.dp, self.place.dps
        index, world = self.place.stage, stages
        self.spec, self.index, self.world, self.link = spec, index, world, link
        self.placement = select(spec.settings.device, local_rank, local_world, spec.devices)
        self.clock = Clock(0.0)
        self.samples: int | None = None  # the last batch's, on rank 0 (for reports and saves)
        # Unattended (``vpipe-lab worker --iterations N``): train until iteration N without waiting for a client.
        self.ctl = Control(iteration=spec.start_iteration, target=spec.settings.iterations or 0)
        fns = load_callables(spec)
        self.model_fn, self.split = fns.model, fns.split
        self.eval_data, self.train_data = fns.eval_data, fns.data
        self.loss_fn = fns.loss or default_loss
        self.peer = Peer(self.global_rank, world * self.replicas,
                         self.placement.device if self.placement.is_cuda else torch.device("cpu"), spec.settings.timeout,
                         base=self.replica * world, replicas=self.replicas)
        # Rank 0 reads the data: batches whose labels ignore positions are counted (runtime/model/counting.py)
        self.rule = counting.Rule.of(_shell(fns.model, spec.settings.seed)) if index == 0 else counting.Rule()
        buffer = BatchBuffer(Path(spec.snapshot_dir)) if spec.snapshot_dir else None
        self.source = Source(fns.data, spec.start_iteration, buffer) if index == 0 else None
        self.chain, self.plan = build_chain(spec, self.model_fn, self.split, index, world, self.peer, self._first_inputs)
        self.num_layers, self.names = len(self.chain), list(self.chain.names)
        if fns.optimizer is None and self.leader:
            log.warning("no optimizer was given: the parameters will not change; pass optimizer=lambda params: ...")
        self.stage = Stage(self.placement.device, fns.optimizer, spec.settings.seed, fns.lr_scheduler,
                           autocast(spec.settings.precision, self.placement.device), wgrad.threshold(spec.settings.fused_wgrad))
        self.data_parallel = self._mesh()
        mine = set(self.plan.layers_of(index))
        for i, unit in enumerate(self.chain.units):
            if i in mine:
                self.stage.add_layer(i, unit, self.chain.tensors[i])
            else:
                to_meta(unit, self.chain.tensors[i])  # only the structure stays: a shell for migration
        self.stage.set_policies({i: self.plan.policies[i] for i in self.stage.owned})
        self.ties = Ties(self.peer, self.stage, self.place, self.plan, self.chain)
        self.scale = LossScale(spec.settings.precision == "fp16")
        self.stepper = Stepper(self.stage, self.ties, self.peer, self.place, spec.settings.clip_grad_norm, self.scale,
                               self.data_parallel)
        recaptures = Recaptures(self.model_fn, self.split, spec.settings.seed, self.peer.device)
        self.shapes = ShapeEpochs(self.peer, recaptures, self.replica,
                                  self.replicas, world * self.replicas)
        self.profiling = profiler.ProfileSchedule()
        budget = spec.settings.budgets[index] if spec.settings.budgets else None
        self.executor = Executor(index, world, self.stage, self.peer, self.placement, self.clock, self.loss_fn, budget,
                                 record_spans=spec.settings.telemetry, chain=self.chain)
        self.model_version = 0
        self.phase = "starting"  # what the control loop is doing outside an iteration's actions (``where``)
        self.heap = Trimmer()
        self.meter = allocator.PeakMeter(self.placement.device)  # what the allocator held at its most
        self.ending = IterationEnd(self)  # the step or the dropped iteration, the report, the pauses
        # the first replica's every shard writes checkpoints: writer shard x stages + stage, which is its global rank
        self.checkpoints = Checkpoints(self.peer, self.stage, self.place.shard * world + index, world * shards,
                                       self.place.replica, self.leader, self.placement.device,
                                       lambda: (self.chain.aliases, self.chain.non_persistent))
        self.migration = Migration(self)
        self.replies = Replies(self)  # acknowledgements, the job as it is now, run/pause/stop/save
        self.commands: dict[type[Body], Callable[[Any], None]] = WorkerCommands(self, self.replies).table()
        self.snapshots = Snapshots(spec.snapshot_dir, index, world, self.replica, spec.settings.snapshot_every)
        if spec.resume_path:
            self.restore(Path(spec.resume_path))
        if spec.restore_snapshot:  # a restarted job (control/workers/restarts.py): back to the newest snapshot
            meta = self.snapshots.restore(Path(spec.restore_snapshot), self.checkpoints.load_directory)
            self.scale.load(meta.loss_scale)
            self.ctl.plan_version, self.model_version = meta.plan_version, meta.model_version

    def dispatch(self, cmd: C.Command) -> None:
        handler = self.commands.get(type(cmd))
        if handler is None:
            raise ValueError(f"stage {self.index} got {type(cmd).__name__} ({cmd.TYPE!r}), which is not a command")
        handler(cmd)

    def _mesh(self) -> DataParallel:
        """The job's mesh (collective: every rank makes it); a sharded stage's units then arrive sharded over its
        shard ranks (engine/shards.py). Rank 0 of each pipeline refuses a first batch the ranks cannot share."""
        data_parallel = DataParallel(self.peer.device, self.place)
        if self.place.shards > 1:
            self.stage.shard(Shards(data_parallel.shard_mesh, self.chain.shared_params(),
                                    self.plan.sharding_of(self.index)))
        if self.source is not None and self.replicas > 1:
            shard(self.source.peek(self.spec.start_iteration)[0], self.replica, self.replicas, "inputs")
        return data_parallel

    def where(self) -> tuple[int, int, str]:
        """Where a failure happened: (iteration, micro-batch or -1, what this rank was doing)."""
        doing = self.executor.where()
        if doing is None:
            return self.ctl.iteration, -1, self.phase
        mb, what, units = doing
        if units is not None:
            a, b = units
            what += (f" in unit {a} ({self.names[a]})" if a == b else
                     f" in units {a}-{b} ({self.names[a]} to {self.names[b]})")
        return self.ctl.iteration, mb, what

    def probe(self) -> dict[str, float]:
        """What the planners' Cluster needs of this rank: its bandwidths and its optimizer's step per byte."""
        bandwidth = probe_bandwidth(self.peer, self.placement, self.index, self.world)
        if self.data_parallel.shard_group is not None:  # a sharded stage: its all-gathers' bandwidth too
            bandwidth |= probe_shards(self.data_parallel.shard_group, self.place.shards, self.placement)
        return bandwidth | probe_update(self.stage.optim.factory, self.placement, [p for _, p in self.stage.params()])

    def _first_inputs(self) -> Any:
        """Rank 0: one micro-batch of the first batch's inputs (what a captured model is captured on)."""
        inputs, _ = self.source.peek(self.ctl.iteration)  # type: ignore[union-attr]
        return split(shard(inputs, self.replica, self.replicas, "inputs"), self.spec.settings.microbatches, "inputs")[0]

    def agree_shapes(self, inputs: Any = None, sharded: bool = True) -> list[int] | None:
        """Every rank, before an iteration (or an evaluation batch: ``inputs``) whose shapes may be new: see
        runtime/shape_epochs.py."""
        desc = None
        if self.index == 0:
            assert self.source is not None
            if inputs is not None:  # an evaluation batch: its inputs alone
                desc = self.shapes.describe(inputs, self.plan.microbatches, sharded, with_targets=False)
            else:
                batch, targets = self.source.peek(self.ctl.iteration)
                desc = self.shapes.describe(batch, self.plan.microbatches, sharded, targets)
        chain = self.shapes.agree(desc, self.chain)
        if chain is not None:
            self.chain = self.executor.chain = self.shapes.adopt(chain, self.stage)
            self.ties.refresh(self.plan, chain)
        return self.shapes.sizes

    # --- the control loop -----------------------------------------------------------------------------------------
    def send(self, body: Body) -> None:
        self.link.send(body.message())

    def boundary(self, violated: bool, ran: bool = False, verdict: int = 0) -> tuple[list[C.Command], bool, int]:
        """Every rank learns here, at the same iteration, whether any rank went over its budget or (``verdict``: 1 +
        a micro-batch) saw a non-finite loss in the iteration just run, and which commands to apply. One all-reduce in
        the common case (no commands); the commands' JSON follows as a broadcast only when rank 0 has some."""
        blob, changed = b"", 0.0
        # Rank 0 checks the batch that runs next (after the one just run, when one ran). It may never run (it lies past
        # the last iteration asked for), so failing to read it must not fail the job: its shapes are agreed anew then.
        if self.index == 0 and self.ctl.active:
            try:
                changed = float(self.shapes.changed(*self.source.peek(self.ctl.iteration + ran)))  # type: ignore[union-attr]
            except Exception:
                changed = 1.0
        if self.leader:
            cmds = self.replies.pending(0.0 if self.ctl.active else 0.2)
            blob = json.dumps(cmds).encode() if cmds else b""
        flag, size, changed, bad, busy, ratio = self.peer.all_max([1.0 if violated else 0.0, float(len(blob)), changed,
                                                                   float(verdict), *self.snapshots.wish()])
        self.snapshots.agree(busy, ratio)
        commands: list[C.Command] = []
        if size > 0:
            docs = self.peer.broadcast_json(json.loads(blob) if self.leader else None)
            commands = [from_doc(doc) for doc in docs]  # type: ignore[misc]  # rank 0 checked them
        if size > 0 or changed > 0:
            # A new shape epoch on every rank at once: commands may change the plan or the run state, and new input
            # shapes change what crosses every boundary (see runtime/engine/comm.py).
            self.peer.reset_shapes()
            self.shapes.start()
            if changed > 0:
                self.profile_soon()
        return commands, flag > 0, int(bad)

    def profile_soon(self) -> None:
        """Measure every layer (times, working sets) again: after start-up, a plan change, new shapes, a reset."""
        self.profiling.soon()
        self.meter.soon()

    # --- checkpoints --------------------------------------------------------------------------------------------------
    def save(self, root: Path, name: str | None = None, keep: int | None = None) -> str | None:
        """A new checkpoint version under ``root`` (see ``runtime/disk/checkpoints.py``); None, or why it failed."""
        version = root / (name or f"ckpt-{self.ctl.iteration:08d}-{self.ctl.plan_version}-{self.model_version}")
        size = self.samples // self.plan.microbatches if self.samples else None  # an export from it keeps the size
        return self.checkpoints.save(version, lambda: Manifest(
            self.ctl.iteration, self.plan.to_dict(), self.num_layers, self.names, self.spec.settings.seed,
            self.ctl.plan_version,
            self.model_version, extra={"loss_scale": self.scale.state(), "microbatch_size": size}, format="dcp",
            units=self.chain.infos()), keep, self.ctl.iteration)

    def restore(self, path: Path) -> None:
        manifest = self.checkpoints.restore(path, self.num_layers)
        self.scale.load(manifest.extra.get("loss_scale", {}))
        self.ctl.plan_version, self.model_version = manifest.plan_version, manifest.model_version

    def snapshot(self) -> None:
        """Every rank, at a boundary where one is due: copy this stage's state for a restart (runtime/disk/snapshots.py)."""
        it, version = self.ctl.iteration, (self.ctl.plan_version, self.model_version)
        meta = (lambda: SnapshotMeta(it, self.plan.to_dict(), *version, self.names, self.scale.state())
                ) if self.leader else None
        self.snapshots.take(it, version, lambda: self.checkpoints.state(it), meta)

    def _save_run(self) -> None:
        """An unattended job's checkpoint in its run directory (the newest three are kept)."""
        assert self.spec.settings.run_dir is not None
        problem = self.save(Path(self.spec.settings.run_dir) / "checkpoints", keep=3)
        if problem is not None:  # training goes on; the next save may succeed (a full disk freed, say)
            log.error("the checkpoint at iteration %d failed: %s", self.ctl.iteration, problem)
        elif self.leader:
            log.info("checkpoint at iteration %d in %s", self.ctl.iteration, self.spec.settings.run_dir)

    def evaluation(self, data: Any, batches: int, cid: int = 0) -> None:
        """Every rank: an evaluation pass at this boundary; the last stage reports its mean loss. Evaluation batches
        may have shapes of their own: each is agreed like a training batch, and training's are agreed again after."""
        found = evaluate(self.executor, self.peer, self.plan, data, batches,
                         lambda inputs: self.agree_shapes(inputs, sharded=False))
        self.shapes.start()
        if found is not None and self.replica == 0:  # every replica evaluates the same batches
            self.send(E.Evaluated(self.index, cid, self.ctl.iteration, **found))

    def after_iteration(self) -> None:
        """Every rank, after an iteration was taken: the periodic evaluation and an unattended job's checkpoint."""
        every = self.spec.settings.eval_every
        if every and self.ctl.iteration % every == 0:
            own = self.eval_data if self.eval_data is not None else self.train_data
            self.evaluation(own if self.index == 0 else None, self.spec.settings.eval_batches)
        every = self.spec.settings.save_every
        if every and self.spec.settings.run_dir and self.ctl.iteration % every == 0:
            self._save_run()

    def unattended_done(self) -> bool:
        """An unattended job ends once it has trained the iterations it was started for (nobody will stop it)."""
        until = self.spec.settings.iterations
        return until is not None and self.ctl.iteration >= until and not self.ctl.paused

    def loop(self) -> None:
        result: IterationResult | None = None
        memory: dict[str, Any] = {}
        stepped: StepReport | None = None
        verdict = 0  # 1 + the micro-batch whose loss was not finite, under nonfinite="pause"/"skip" (iteration_end.py)
        while True:
            self.phase = "at the iteration boundary"
            commands, failed, bad_loss = self.boundary(result is not None and result.violation is not None,
                                                       result is not None, verdict)
            if result is not None:
                self.phase = "the optimizer step"
                if self.ending.finish(result, failed, memory, stepped, bad_loss):
                    self.phase = "after the iteration (evaluation, checkpoint)"
                    self.after_iteration()
                self.heap.maybe(self.ctl.iteration)  # return freed memory to the system now and then (runtime/heap.py)
                result, verdict = None, 0
            for cmd in commands:
                self.phase = f"applying {type(cmd).__name__}"
                self.dispatch(cmd)
            if self.ctl.stopping:
                return
            if self.snapshots.due(self.ctl.iteration, (self.ctl.plan_version, self.model_version)):
                self.phase = "taking a snapshot"
                self.snapshot()
            if self.unattended_done():
                self.finish_unattended()
                return
            if self.ctl.active:
                if self.shapes.renew:
                    self.phase = "checking the batch's shapes"
                    try:
                        self.agree_shapes()
                    except BadBatch as exc:  # every rank learns it from rank 0 at once: pause, nothing changed
                        self.ending.refuse_batch(exc)
                        continue
                self.executor.loss_multiplier = self.scale.scale
                result = self.iteration()
                self.snapshots.observe(result.end_s - result.start_s)
                memory = self.executor.memory()
                self.phase = "the optimizer step"
                verdict = self.ending.loss_verdict(result)
                stepped = self.stepper.step(result.iteration) if self.ending.steps_early() else None

    def finish_unattended(self) -> None:
        """An unattended job that is done saves a last checkpoint, so its last iterations are not lost to a restart."""
        every = self.spec.settings.save_every
        if self.spec.settings.run_dir and not (every and self.ctl.iteration % every == 0):
            self._save_run()
        log.info("trained to iteration %d; the unattended job ends", self.ctl.iteration)

    def iteration(self) -> IterationResult:
        """Rank 0 reads the batch and sends the targets to the stage that computes the loss (the last; under ZBV
        rank 0 itself), which alone needs them."""
        it = self.ctl.iteration
        batch: tuple[Any, Any] | None = None
        counts: list[int] | None = None
        self.samples = None
        self.phase = "reading the batch" if self.index == 0 else "receiving the targets"
        if self.index == 0:
            assert self.source is not None
            inputs, targets = self.source.get(it)
            if self.shapes.agreed is None:  # the whole batch's, as the boundary compares the next whole batch with it
                self.shapes.agreed = signature(inputs, targets)
            inputs = shard(inputs, self.replica, self.replicas, "inputs")
            targets = shard(targets, self.replica, self.replicas, "targets")
            self.samples = batch_size(inputs)
            counts = counting.counts(inputs, targets, self.plan.microbatches, self.rule)
            if self.plan.loss_stage != 0:  # the counts go along, always as M numbers (-1: none), so the shapes hold
                told = torch.tensor(counts if counts is not None else [-1] * self.plan.microbatches)
                self.peer.post_send({"targets": targets, "counts": told}, self.plan.loss_stage, TAG_TARGET,
                                    agreed=True, exact=True)
            batch = (inputs, targets)
        elif self.index == self.plan.loss_stage:
            got = self.peer.wait(self.peer.post_recv(0, TAG_TARGET, agreed=True))
            batch = (None, got["targets"])
            counts = [int(c) for c in got["counts"].tolist()] if int(got["counts"][0]) >= 0 else None
        self.stage.mb_offset = self.replica * self.plan.microbatches
        profile, drop = self.profiling.next(it)
        if drop:
            self.stage.reset_stats()
        measured = profile and not (drop or self.profiling.cold)
        # what the stage holds as the window opens (the batch was read before it), only when this one is measured
        held = allocator.held(self.stage) + allocator.data_bytes(batch) if self.meter.due(it, measured) else 0
        self.stage.probing = not self.meter.start(it, held, measured)
        self.phase = "the iteration"
        return self.executor.run(it, self.plan, batch, profile=profile, sizes=self.shapes.sizes, counts=counts)
