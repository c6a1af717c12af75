"""``engine="torch"``: a rank that trains the planned job on torch.distributed.pipelining's own runtime, from the
plan's export bundle, with the lab around it.

The rank speaks the lab's protocol (``Replies``: run, pause, stop, save; ``TorchState``: apply, state, profile) so the
Session, the dashboard and the editor work unchanged; what differs is the engine underneath. Every rank builds the
whole model (torch's ``pipeline()`` traces it whole), writes the plan's bundle into a directory of its own and takes
its stages from ``runtime/torch_pp/pipeline.py``; an iteration is torch's ``schedule.step``, timed action by action
(``TorchPipeline.record``) and with the activations its autograd saves counted. A plan change is a reshard, not a
live migration: every rank saves its state as a DCP checkpoint (the one ``session.save`` writes, into the job's
checkpoint when the apply asks for one), builds the new plan's stages from a fresh model and loads its own units'
tensors and optimizer state back by name. What the lab's engine measures per layer, torch's cannot: a profile here
is each stage's measured forward and backward time spread over its units by their parameter bytes. With shards or
replicas each data-parallel rank runs a pipeline of its own over its share of the batch, its stages sharded with
``fully_shard`` (or replicated with torch's ``replicate``) as torchtitan composes them
(``runtime/torch_pp/sharded_pipeline.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from vpipe_lab.core.interop.bundle import UnitInfo, make
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.settings import engine_refusal
from vpipe_lab.core.timeline import KINDS
from vpipe_lab.runtime.build import _example, initial_plan, on_meta
from vpipe_lab.runtime.engine.comm import TAG_TARGET, Peer
from vpipe_lab.runtime.engine.device import select
from vpipe_lab.runtime.engine.executor import default_loss
from vpipe_lab.runtime.iteration_end import first_nonfinite, unattended_stop
from vpipe_lab.runtime.memory.ledger import local_tensor, tensor_bytes
from vpipe_lab.runtime.model.batches import Source, batch_size, rebuild, split
from vpipe_lab.runtime.model.callables import load_callables
from vpipe_lab.runtime.model.capture import build_model, capture
from vpipe_lab.runtime.progress import Control
from vpipe_lab.runtime.torch_pp.engine_state import TorchState
from vpipe_lab.runtime.torch_pp.pipeline import TorchPipeline, torch_pipeline
from vpipe_lab.runtime.training.place import Place
from vpipe_lab.runtime.training.replicas import shard
from vpipe_lab.runtime.worker_commands import Replies
from vpipe_lab.wire import commands as C
from vpipe_lab.wire import events as E
from vpipe_lab.wire.bundle_files import write as write_bundle
from vpipe_lab.wire.channel import Link
from vpipe_lab.wire.codec import Body, from_doc
from vpipe_lab.wire.jobspec import JobSpec

log = logging.getLogger("vpipe_lab.torch_engine")
KIND = {"F": "forward", "B": "backward", "I": "backward", "W": "wgrad"}
MEASURE_EVERY = 20  # iterations between two counts of the activations autograd saves (see ``iteration``)


class SavedBytes:
    """The bytes autograd holds for backward while an iteration runs, at their peak (saved-tensor hooks; a tensor is
    counted until autograd lets go of it)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        size = t.numel() * t.element_size()
        self.live += size
        self.peak = max(self.peak, self.live)
        holder = _Held(t)
        weakref.finalize(holder, self._free, size)
        return holder

    def _free(self, size: int) -> None:
        self.live -= size

    @staticmethod
    def unpack(holder: Any) -> torch.Tensor:
        return holder.tensor

    def hooks(self) -> Any:
        self.live = self.peak = 0  # a new count: the peak reported until the next one is this one's
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class TorchWorker:
    """One rank of a pipeline that torch.distributed.pipelining runs (see the module docstring)."""

    def __init__(self, spec: JobSpec, rank: int, world: int, link: Link, local_rank: int, local_world: int) -> None:
        problem = engine_refusal(spec.settings.engine, spec.settings.replicas, spec.settings.precision,
                                 spec.settings.schedule, spec.settings.shards)
        if problem:
            raise ValueError(problem)
        self.spec, self.link, self.global_rank, self.leader = spec, link, rank, rank == 0
        self.phase, self._in_loss = "starting", False  # what a failure names (``where``)
        # the job's mesh (runtime/training/place.py): a pipeline per data-parallel rank (shards x replicas)
        self.place = Place(rank, spec.settings.stages, spec.settings.shards, spec.settings.replicas)
        self.index, self.world, self.replica = self.place.stage, self.place.stages, self.place.dp
        self.placement = select(spec.settings.device, local_rank, local_world, spec.devices)
        self.ctl = Control(iteration=spec.start_iteration, target=spec.settings.iterations or 0)
        fns = load_callables(spec)
        self.model_fn, self.split, self.train_data, self.eval_data = fns.model, fns.split, fns.data, None
        self.optimizer_fn, self.scheduler_fn, self.user_loss = fns.optimizer, fns.lr_scheduler, fns.loss or default_loss
        self.peer = Peer(rank, world, self.placement.device if self.placement.is_cuda else torch.device("cpu"),
                         spec.settings.timeout, base=self.place.dp * self.world, replicas=self.place.dps)
        self.source = Source(fns.data, spec.start_iteration) if self.index == 0 else None
        self.chain, self.example = self._units(self.index, self.world)
        self.names, self.num_layers = list(self.chain.names), len(self.chain)
        self.units = [UnitInfo.from_dict(d) for d in self.chain.infos()]
        self.plan = initial_plan(spec, self.chain, self.index, self.world, self.peer)
        self.record_spans, self.saved = spec.settings.telemetry, SavedBytes()
        self.model_version, self.samples = 0, 0
        self.stats: dict[int, dict[str, list[float]]] = {}  # torch stage -> action letter -> seconds (and "held")
        self._dir = Path(tempfile.mkdtemp(prefix=f"vpipe-torch-{spec.session_id}-r{rank}-"))
        self.torch_state = state = TorchState(self)  # checkpoints, reshards, tensors, profiles
        self.save = state.save  # what a Save command and the run directory's checkpoints call
        self.replies = r = Replies(self)  # acknowledgements, the job as it is now, run/pause/stop/save
        self.commands: dict[type[Body], Callable[[Any], None]] = {
            C.Run: r.run, C.Pause: r.run_state, C.Resume: r.run_state, C.Stop: r.run_state, C.Ping: r.ack,
            C.Profile: state.profile, C.State: state.answer_state, C.Telemetry: state.telemetry,
            C.Evaluate: state.evaluate, C.Save: r.save, C.Apply: state.apply_plan, C.SetModel: state.set_model}
        self.build(self.plan)
        if spec.resume_path:
            state.load(Path(spec.resume_path))

    def _units(self, rank: int, world: int) -> tuple[Any, Any]:
        """The model cut into the lab's units (their names, modules and output structure; on the meta device where
        the model builds there), and one micro-batch of zeros shaped like the first batch's inputs (rank 0 reads the
        data and describes it to the others), which torch's ``pipeline()`` traces the model on."""
        meta = None
        if not isinstance(self.model_fn, torch.nn.Module):
            try:
                meta = on_meta(self.model_fn, self.spec.settings.seed)[0]
            except Exception:  # a factory that needs real tensors to build
                meta = None
        model = meta if meta is not None else build_model(self.model_fn, self.spec.settings.seed)
        desc = _example(model, self.split, rank, world, self.peer, self._first_inputs)
        try:
            chain = capture(model.train(), rebuild(desc, device=torch.device("meta") if meta is not None else None)
                            if desc else None, self.split, self.peer.device)
        except Exception:
            if meta is None:
                raise
            chain = capture(build_model(self.model_fn, self.spec.settings.seed), rebuild(desc) if desc else None, self.split)
        return chain, rebuild(desc) if desc else None

    def _first_inputs(self) -> Any:
        inputs, _ = self.source.peek(self.ctl.iteration)  # type: ignore[union-attr]
        mine = shard(inputs, self.place.dp, self.place.dps, "inputs")  # a data-parallel pipeline's share
        return split(mine, self.spec.settings.microbatches, "inputs")[0]

    # --- building the stages from a plan ------------------------------------------------------------------------
    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """The user's loss on the model's own output object (torch's last stage returns its flattened leaves)."""
        if isinstance(output, (tuple, list)) and self.chain.out_spec is not None \
                and len(output) == self.chain.out_spec.num_leaves:
            output = pytree.tree_unflatten(list(output), self.chain.out_spec)
        self._in_loss = True
        value = self.user_loss(output, None if self._no_targets else target)
        self._in_loss = False
        return value

    def where(self) -> tuple[int, int, str]:
        """Where a failure happened: (iteration, micro-batch or -1, what this rank was doing)."""
        running = self.pp.running if hasattr(self, "pp") else None
        if self._in_loss and running is None:  # torch's schedule computes a loss right after its forward
            forwards = [a for a in self.actions if a.op == "F"]
            running = (forwards[-1].stage, "F", forwards[-1].microbatch) if forwards else None
        if running is None:
            return self.ctl.iteration, -1, self.phase
        stage, letter, mb = running
        what = "the loss" if self._in_loss else {"F": "forward", "B": "backward", "I": "input gradient",
                                                 "W": "weight gradient"}.get(letter, letter)
        return self.ctl.iteration, mb, f"{what} of torch's stage {stage}"

    def build(self, plan: Plan) -> None:
        """This rank's stages of ``plan`` from a fresh build of the model, with a new optimizer and scheduler."""
        bundle = make(plan, self.units)
        path = write_bundle(self._dir / f"bundle-v{self.ctl.plan_version}", bundle)
        model = build_model(self.model_fn, self.spec.settings.seed)
        model.to(self.placement.device)
        self.pp: TorchPipeline = torch_pipeline(model, path, self.global_rank if self.place.dps > 1 else self.index,
                                                example=self.example, loss_fn=self._loss,
                                                device=self.placement.device)
        self.actions = self.pp.record()
        self.named = dict(self.pp.named_parameters())
        self.optimizer = self.optimizer_fn(list(self.named.values())) if self.optimizer_fn is not None else None
        self.scheduler = None
        if self.scheduler_fn is not None and self.optimizer is not None:
            self.scheduler = self.scheduler_fn(self.optimizer)
        self._no_targets = False
        self.unit_of = self._map_units()
        self._measured_from = self.ctl.iteration  # a new plan: its activations are counted anew

    def _map_units(self) -> dict[str, int]:
        """Parameter name -> the unit that holds it (by the units' module names)."""
        out = {}
        for name in self.named:
            best, length = -1, -1
            for i, unit in enumerate(self.units):
                for prefix in (*unit.modules, *unit.tensors):
                    if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > length:
                        best, length = i, len(prefix)
            out[name] = best
        return out

    def probe(self) -> dict[str, float]:
        from vpipe_lab.runtime.engine.bandwidth import probe_bandwidth

        return {**probe_bandwidth(self.peer, self.placement, self.index, self.world), "update_s_per_byte": 0.0,
                "copy_s_per_byte": 0.0}

    # --- the control loop -----------------------------------------------------------------------------------------
    def send(self, body: Body) -> None:
        self.link.send(body.message())

    def boundary(self) -> list[C.Command]:
        """Every rank learns the controller's commands at the same iteration (as the lab's workers do), and the coming
        batch's size, negative when it has no targets (the model computes its own loss)."""
        blob = b""
        coming = 0.0
        if self.index == 0 and not self.ctl.stopping:
            try:  # the batch that runs next, if one does (a run may start at this boundary)
                inputs, targets = self.source.peek(self.ctl.iteration)  # type: ignore[union-attr]
                coming = float(batch_size(inputs) or 0) * (-1.0 if targets is None else 1.0)
            except Exception:  # past the data's end, say: its shapes are read again when it runs
                coming = 0.0
        if self.leader:
            cmds = self.replies.pending(0.0 if self.ctl.active else 0.2)
            blob = json.dumps(cmds).encode() if cmds else b""
        size, coming = self.peer.all_max([float(len(blob)), coming if self.index == 0 else -1e18])
        self.samples, self._no_targets = int(abs(coming)), coming < 0
        if size <= 0:
            return []
        docs = self.peer.broadcast_json(json.loads(blob) if self.leader else None)
        return [from_doc(doc) for doc in docs]  # type: ignore[misc]

    def dispatch(self, cmd: C.Command) -> None:
        self.commands[type(cmd)](cmd)

    def loop(self) -> None:
        while True:
            self.phase = "at the iteration boundary"
            for cmd in self.boundary():
                self.phase = f"applying {type(cmd).__name__}"
                self.dispatch(cmd)
            if self.ctl.stopping:
                return
            until = self.spec.settings.iterations
            if until is not None and self.ctl.iteration >= until and not self.ctl.paused:
                self._save_run(final=True)
                return
            if self.ctl.active:
                self.phase = "the iteration"
                self.iteration()
                self.phase = "saving a checkpoint"
                self._save_run()

    def _save_run(self, final: bool = False) -> None:
        """An unattended job's checkpoints in its run directory, every ``save_every`` iterations and at its end."""
        every, run_dir = self.spec.settings.save_every, self.spec.settings.run_dir
        if not run_dir or not (final or (every and self.ctl.iteration % every == 0)):
            return
        if final and every and self.ctl.iteration % every == 0:
            return  # the last iteration's checkpoint was just taken
        problem = self.save(Path(run_dir) / "checkpoints", keep=3)
        if problem is not None:
            log.error("the checkpoint at iteration %d failed: %s", self.ctl.iteration, problem)

    def iteration(self) -> None:
        it = self.ctl.iteration
        inputs = targets = None
        loss_rank = self.plan.loss_stage
        if self.index == 0:
            inputs, targets = self.source.get(it)  # type: ignore[union-attr]
        if self._no_targets and self.index == loss_rank:
            targets = torch.zeros(self.samples)  # torch splits a target per micro-batch; the loss is given None
        elif loss_rank != 0 and self.index in (0, loss_rank):
            if self.index == 0:  # the whole batch's targets: torch_pipeline takes this pipeline's share
                self.peer.post_send(targets, loss_rank, TAG_TARGET, agreed=True, exact=True)
                self.peer.flush()
            else:
                targets = self.peer.wait(self.peer.post_recv(0, TAG_TARGET, agreed=True))
        self.actions.clear()
        start = time.perf_counter()
        # Counting saved tensors costs a Python call per tensor (15% of a zero-bubble iteration of gpt-tiny), so it
        # runs on the first iterations of each plan and then every MEASURE_EVERY-th; memory keeps the last count.
        measure = it < self._measured_from + 3 or it % MEASURE_EVERY == 0
        with self.saved.hooks() if measure else contextlib.nullcontext():
            losses = self.pp.step(inputs, target=targets)
        self.phase = "the optimizer step"
        found = [float(x.detach()) for x in losses or []]
        skip = self._loss_verdict(it, found)
        if skip is None:  # paused before the step, nothing changed
            return
        grad_norm = None if skip else self._clip()
        lr = float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else None
        if self.optimizer is not None and not skip:
            self.optimizer.step()
        memory = self.memory()  # gradients and the optimizer's state both held, as at the step
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        end = time.perf_counter()
        self._note(self.actions)
        self.ctl.iteration += 1
        self.report(it, start, end, found, grad_norm, lr, memory, skip)

    def _loss_verdict(self, it: int, losses: list[float]) -> bool | None:
        """Under nonfinite="pause"/"skip", every rank learns whether the loss stage saw a NaN or infinite loss (one
        all-reduce): False to step, True to skip the step, None when the iteration was dropped and training paused
        (as the lab's engine does, runtime/iteration_end.py)."""
        if self.spec.settings.nonfinite == "continue":
            return False
        mb, value = first_nonfinite(losses)
        bad = int(self.peer.all_max([mb + 1.0])[0])
        if not bad:
            return False
        if self.spec.settings.nonfinite == "skip":
            return True
        if self.spec.settings.iterations is not None:
            raise unattended_stop(it, bad - 1, losses)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.ctl.paused = True
        if mb >= 0:
            self.send(E.Failure("loss", self.index, self.index, 0, it, cause=value, microbatch=mb))
        return None

    def _note(self, actions: list[Any], keep: int = 512) -> None:
        """Each action's time by stage and letter, the micro-batches held at once and the saved bytes' peak."""
        held: dict[int, int] = {}
        for a in actions:
            times = self.stats.setdefault(a.stage, {})
            letter = "B" if a.op in ("B", "I") else a.op
            times.setdefault(letter, []).append(a.end - a.start)
            held[a.stage] = held.get(a.stage, 0) + (1 if a.op == "F" else -1 if a.op in ("B", "I") else 0)
            times.setdefault("held", []).append(float(held[a.stage]))
            for key in times:
                del times[key][:-keep]
        self.stats.setdefault(-1, {}).setdefault("peak", []).append(float(self.saved.peak))
        del self.stats[-1]["peak"][:-keep]

    def _clip(self) -> float | None:
        """``clip_grad_norm``: the global 2-norm over every rank's gradients, as one process's clip gets it."""
        if self.spec.settings.clip_grad_norm is None:
            return None
        grads = [local_tensor(p.grad) for p in self.named.values() if p.grad is not None]  # a sharded one: its shard
        # a shard's squares are repeated on every replica; a whole gradient's on every data-parallel rank
        whole = [g is p.grad for g, p in zip(grads, (p for p in self.named.values() if p.grad is not None))]
        local = sum(float(g.detach().float().pow(2).sum()) / (self.place.dps if w else self.place.replicas)
                    for g, w in zip(grads, whole))
        total = self.peer.all_sum([local])[0] ** 0.5
        scale = self.spec.settings.clip_grad_norm / (total + 1e-6)
        if scale < 1:
            for g in grads:
                g.mul_(scale)
        return total

    def memory(self) -> dict[str, Any]:
        params = list(self.named.values())  # a sharded stage's: this rank's shards (ledger.tensor_bytes)
        static = {"params": sum(tensor_bytes(p) for p in params),
                  "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
                  "optimizer": sum(tensor_bytes(v) for s in (self.optimizer.state.values() if self.optimizer else ())
                                   for v in s.values() if isinstance(v, torch.Tensor))}
        total = sum(static.values())
        return {**static, "static": total, "activations": self.saved.peak, "resident": self.saved.peak, "host": 0,
                "stash": 0, "peak": total + self.saved.peak,
                "budget": self.spec.settings.budgets[self.index] if self.spec.settings.budgets else None}

    def report(self, it: int, start: float, end: float, losses: list[float], grad_norm: float | None,
               lr: float | None, memory: dict[str, Any], skipped: bool = False) -> None:
        local = {s.stage: i for i, s in enumerate(self.pp.bundle.stages_of(self.index))}
        spans = ([(KINDS.index(KIND[a.op]), a.microbatch, -1, a.start, a.end, local.get(a.stage, 0))
                  for a in self.actions] if self.record_spans else [])
        share = self.samples // self.place.dps if self.index == 0 else None  # this pipeline's samples
        self.send(E.IterationReport(it, self.index, start, end, losses, memory, spans, self.plan.microbatches,
                                    self.ctl.plan_version, self.replica, share, None, grad_norm, lr, None, skipped))
