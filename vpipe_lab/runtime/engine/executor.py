"""Runs one iteration of a stage: walks its row of the core schedule IR, timing every action onto a span.

The ``Executor`` prepares the stage for an iteration (loss scales, split backward, micro-batches) and assembles the
result; the walk over the row, one method per action kind, is ``iteration.StageIteration``.

Micro-batches are ``torch.chunk`` of the mini-batch along dim 0; each micro-batch's loss is scaled by 1/M, so the
gradients are those of the mean of the per-micro-batch losses and a pipelined step equals a plain full-batch step.
Under PipeDream (an asynchronous schedule kind, ``plan.kind.asynchronous``) each micro-batch is a step of its own
instead: its loss unscaled, the stage's optimizer stepping after its backward on the weights its forward used
(``stash.py``).

A forward or backward runs the stage's fused segments (see ``stage.Stage``); in a *profiling* iteration every layer
runs and is timed on its own, for the online profiler, and the caller decides which iterations profile. Transfers
use the shape-agreed path of ``comm.Peer``: the next receive of each kind is posted as soon as the previous one has
arrived, and consecutive transfer actions go out as one batch. Spans are marks of a ``Stopwatch``, so a GPU is not
synchronised between actions; losses stay tensors until the iteration ends. While a torch profiler records, every
action runs inside a ``torch.profiler.record_function`` labelled like the timeline (``vpipe/forward mb2``), so a
torch.profiler trace of a worker reads like vpipe_lab's own timeline.

With virtual stages (interleaved 1F1B, ZBV) a rank holds several chunks: each action runs on its chunk's segments, a
chunk's input comes from the rank of the chunk before it (``plan.placement``: under interleaved 1F1B the last rank's
last chunk of a lap sends to rank 0), every chunk-to-chunk stream has a tag of its own (``tag_into``), and two
neighbouring chunks on one rank (ZBV's turn on the last rank) hand over their tensors in place. The loss is computed
on the rank of the last chunk (``plan.loss_stage``: rank 0 under ZBV), which therefore gets the targets.

``evaluate`` is the forward-only pass: every micro-batch forward through the stages with the layers in eval mode and
no autograd, the last stage returning the losses; no gradient, optimizer state or statistic of training changes.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules.actions import KIND, Action, Op, Schedule
from vpipe_lab.core.schedules.builders import for_plan
from vpipe_lab.runtime.engine import faults
from vpipe_lab.runtime.engine.comm import TAG_EVAL, Peer
from vpipe_lab.runtime.engine.device import Clock, Placement, Stopwatch
from vpipe_lab.runtime.engine.iteration import (
    BudgetViolation,
    IterationResult,
    LossFn,
    StageIteration,
    Step,
    chunk_tag,
)
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.model import counting
from vpipe_lab.runtime.model.batches import loss_with_check, split, to_device
from vpipe_lab.runtime.model.capture import Chain, for_inference


def default_loss(output: Any, target: Any, num_items_in_batch: int | None = None) -> torch.Tensor:
    """The model's own loss when it computed one (HuggingFace models given ``labels``); else cross-entropy over the
    last dimension for integer targets (positions marked -100 ignored; with ``num_items_in_batch`` the sum over this
    micro-batch divided by the whole batch's count: ``runtime/model/counting.py``) and mean squared error otherwise,
    on the logits when the output has them."""
    own = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
    if target is None:
        if own is None:
            raise ValueError("the data gave no targets and the model's output has no loss: give (inputs, targets) "
                             "or a loss function")
        return own
    if not isinstance(output, torch.Tensor):
        logits = getattr(output, "logits", None) if not isinstance(output, dict) else output.get("logits")
        output = logits if logits is not None else output[0]
    if isinstance(target, torch.Tensor) and not target.is_floating_point():
        logits, labels = output.reshape(-1, output.shape[-1]), target.reshape(-1)
        if num_items_in_batch is not None:
            return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch
        return torch.nn.functional.cross_entropy(logits, labels)
    return torch.nn.functional.mse_loss(output, target)


class Executor:
    """Executes a stage's schedule for each iteration."""

    def __init__(self, rank: int, world: int, stage: Stage, peer: Peer, placement: Placement, clock: Clock,
                 loss_fn: LossFn, budget: int | None = None, record_spans: bool = True,
                 chain: Chain | None = None) -> None:
        self.rank, self.world = rank, world
        self.stage, self.peer, self.placement, self.clock = stage, peer, placement, clock
        self.watch = Stopwatch(placement, clock)
        self.chain = chain
        self.loss_fn = loss_with_check(loss_fn, chain.finish if chain is not None else (lambda out: out))
        self.loss_counts = counting.names_count(loss_fn)  # the loss takes the batch's count of items
        self.budget = budget
        self.record_spans = record_spans
        self._schedule: tuple[Plan, Schedule, dict[int, Step | None], dict[Op, Step | None]] | None = None
        self.fault = faults.parse()
        self._static = self._param_bytes = 0
        self.loss_multiplier = 1.0  # the fp16 loss scale (see runtime/training/precision.py); 1 otherwise
        self.action: Action | None = None  # the action running (None between iterations): a failure names it
        self.in_loss = False  # the loss function is running

    def where(self) -> tuple[int, str, tuple[int, int] | None] | None:
        """What this stage was doing, for a failure: (micro-batch, what, units) or None between iterations."""
        action = self.action
        if action is None:
            return None
        units = self.stage.at_units if action.op in (Op.F, Op.B, Op.RECOMPUTE) and not self.in_loss else None
        what = "the loss" if self.in_loss else {Op.RECV_F: "receiving its input", Op.RECV_B: "receiving a gradient",
                                                Op.SEND_F: "sending its output", Op.SEND_B: "sending a gradient",
                                                }.get(action.op, KIND[action.op])
        return action.microbatch, what, units

    def schedule(self, plan: Plan) -> Schedule:
        return self._plan(plan)[1]

    def _plan(self, plan: Plan) -> tuple[Plan, Schedule, dict[int, Step | None], dict[Op, Step | None]]:
        """The schedule; for each receive step the (chunk, micro-batch) of the next receive of the same kind; and
        that of the first receive of each kind (worked out once per plan, not per iteration)."""
        if self._schedule is None or self._schedule[0] != plan:
            schedule = for_plan(plan)
            row = schedule.stages[self.rank]
            following: dict[int, Step | None] = {}
            for i, action in enumerate(row):
                if action.op in (Op.RECV_F, Op.RECV_B):
                    following[i] = next(((a.stage, a.microbatch) for a in row[i + 1:] if a.op is action.op), None)
            firsts = {op: next(((a.stage, a.microbatch) for a in row if a.op is op), None)
                      for op in (Op.RECV_F, Op.RECV_B)}
            self._schedule = (plan, schedule, following, firsts)
        return self._schedule

    def _check_budget(self, result: IterationResult) -> None:
        if self.budget is None or result.violation is not None:
            return
        # Parameters and optimizer state are fixed within an iteration; gradients appear with the first backward
        # and are parameter-sized. Walking every tensor after each layer would put O(parameters) on the hot path.
        static = self._static + (self._param_bytes if self.stage.ledger.in_backward else 0) + self.stage.stash.current
        used = static + self.stage.ledger.current
        if used > self.budget:
            per_layer = self.stage.ledger.by_layer_peak(self.stage.owned)
            kept = sorted(((i, b) for i, b in per_layer.items() if self.stage.layers[i].policy.value == "keep"),
                          key=lambda x: -x[1])
            result.violation = BudgetViolation(self.rank, used, self.budget, kept)

    def run(self, iteration: int, plan: Plan, batch: tuple[Any, Any] | None, profile: bool = False,
            sizes: list[int] | None = None, counts: list[int] | None = None) -> IterationResult:
        """One iteration; ``profile`` runs every layer on its own and times it (with the device synchronised).
        ``sizes``: the samples in each micro-batch (agreed by every rank: runtime/shape_epochs.py). When they differ
        (a short last batch) each micro-batch's loss counts by its samples, and each transfer says its shapes.
        ``counts`` (the loss stage): each micro-batch's counted items when its labels ignore some positions; the
        losses are then normalised by the batch's count (``runtime/model/counting.py``)."""
        uneven = sizes is not None and len(sizes) == plan.microbatches and len(set(sizes)) > 1
        loss_fn, weights = self._prepare(iteration, plan, batch, sizes if uneven else None, counts)
        inputs, targets = self._micro_batches(plan, batch)
        walk = StageIteration(self, iteration, plan, inputs, targets, loss_fn, profile, agreed=not uneven)
        result = walk.walk()
        result.end_s = self.watch.end()
        seconds = self.watch.seconds
        result.spans = [(kind, mb, layer, seconds(a), seconds(b), c) for kind, mb, layer, a, b, c in walk.marks]
        result.losses = [float(v) for v in walk.losses]
        if weights is not None and walk.losses:  # each micro-batch's share of the batch's loss: their sum is it
            result.losses = [v * w for v, w in zip(result.losses, weights)]
            result.loss_sum = True
        result.sizes = list(sizes) if sizes is not None else None
        return result

    def _prepare(self, iteration: int, plan: Plan, batch: tuple[Any, Any] | None, uneven: list[int] | None,
                 counts: list[int] | None) -> tuple[LossFn, list[float] | None]:
        """Set the stage up for the iteration: PipeDream's stash, each micro-batch's loss scale (by its samples
        when ``uneven`` gives them, by its counted items when ``counts`` do), B/W split, memory peaks; returns the
        loss to call and the losses' weights (``_counted``)."""
        stage = self.stage
        self.in_loss = False
        stage.stash.on = plan.kind.asynchronous  # PipeDream: an update after every backward (stash.py)
        stage.stash.reset()
        # each micro-batch's mean loss is a step of its own under PipeDream; else 1/M of the iteration's step
        stage.loss_scale = self.loss_multiplier / (1 if stage.stash.on else plan.microbatches)
        stage.scales = [self.loss_multiplier * (n / sum(uneven)) for n in uneven] if (
            uneven and not stage.stash.on) else None
        loss_fn, weights = self._counted(plan, batch, counts)
        if weights is not None:
            stage.scales = [self.loss_multiplier * w for w in weights]
        stage.iteration = iteration
        stage.split_backward(plan.kind.split_backward)  # B then W (core/schedules/orders/zero_bubble.py), or one
        if stage.shards is not None:  # its collectives are timed on this iteration's marks
            stage.shards.clock = self.watch.mark
            stage.shards.spans.clear()
            stage.shards.whole_peak = 0
        stage.ledger.reset_peaks()
        if self.budget is not None:
            static = stage.static_bytes()
            self._param_bytes = static["params"]
            self._static = sum(static.values())
        return loss_fn, weights

    def _micro_batches(self, plan: Plan, batch: tuple[Any, Any] | None) -> tuple[list[Any] | None, list[Any] | None]:
        """The inputs (first stage) and targets (the loss's stage) split into the plan's micro-batches."""
        if batch is None:
            return None, None
        m = plan.microbatches
        inputs = split(batch[0], m, "inputs") if self.rank == 0 else None
        targets = None
        if self.rank == plan.loss_stage:
            targets = [None] * m if batch[1] is None else split(batch[1], m, "targets")
        return inputs, targets

    def _counted(self, plan: Plan, batch: tuple[Any, Any] | None, counts: list[int] | None
                 ) -> tuple[LossFn, list[float] | None]:
        """The loss to call and each micro-batch's weight in the iteration's loss when labels ignore positions
        (``runtime/model/counting.py``): 1 each where the loss takes ``num_items_in_batch`` (then over the batch's
        count), else its share of the count. None: weights as before (1/M, or samples)."""
        total = sum(counts) if counts else 0
        if not counts or total <= 0 or self.stage.stash.on or len(counts) != plan.microbatches:
            return self.loss_fn, None
        own = batch is None or batch[1] is None  # the model computes its loss from labels among its inputs
        if not own and self.loss_counts:
            return counting.with_count(self.loss_fn, total), [1.0] * len(counts)
        return self.loss_fn, [c / total for c in counts]

    def evaluate(self, plan: Plan, batch: tuple[Any, Any] | None) -> list[float]:
        """Forward only, micro-batch after micro-batch (no schedule is needed without a backward); returns the last
        stage's per-micro-batch losses (empty elsewhere). Modules are in eval mode for the pass (dropout off, batch
        norm on its running statistics, which it then does not update) and back in train mode after."""
        rank, last, m = self.rank, self.rank == plan.loss_stage, plan.microbatches
        stage, peer, chain = self.stage, self.peer, self.chain
        top, at = plan.chunks - 1, plan.placement
        inputs = split(batch[0], m, "inputs") if batch is not None and rank == 0 else None
        targets = None
        if batch is not None and last:
            targets = [None] * m if batch[1] is None else split(batch[1], m, "targets")
        modules = {i: for_inference(stage.layers[i].module) for i in stage.owned}
        losses: list[torch.Tensor] = []
        # a sharded stage's inference units share its gathered parameters: whole for the pass, on every shard
        whole = stage.shards.gathered() if stage.shards is not None else nullcontext()
        try:
            with torch.no_grad(), whole:
                for mb in range(m):
                    for c in plan.chunks_of(rank):  # each micro-batch through this rank's chunks, in model order
                        with torch.profiler.record_function(f"vpipe/eval mb{mb}"):
                            if c == 0:
                                x = to_device(inputs[mb], self.placement.device)  # type: ignore[index]
                                x = chain.start(x) if chain is not None else x
                            elif at[c - 1] != rank:  # else x is the chunk before's output, on this rank too
                                got = peer.recv(at[c - 1], chunk_tag(TAG_EVAL, c, plan))
                                x = chain.unpack(plan.boundaries[c] - 1, got) if chain is not None else (
                                    got[0] if isinstance(got, tuple) and len(got) == 1 else got)
                            for i in plan.chunk_layers(c):
                                with stage.autocast():
                                    x = modules[i][0](x)
                            if c == top:
                                target = to_device(targets[mb], self.placement.device)  # type: ignore[index]
                                with stage.autocast():
                                    losses.append(self.loss_fn(x, target).detach())
                            elif at[c + 1] != rank:
                                peer.send(chain.pack(x) if chain is not None else x, at[c + 1],
                                          chunk_tag(TAG_EVAL, c + 1, plan))
            peer.flush()
        finally:
            for module, back in modules.values():
                if back:
                    module.train()
        return [float(v) for v in losses]

    def memory(self) -> dict[str, Any]:
        """This stage's memory in the iteration just run, as reported to the controller (peaks, then reset)."""
        static = self.stage.static_bytes()
        ledger = self.stage.ledger
        stash = self.stage.stash.reset_peak()  # PipeDream's stashed weight copies, at their most
        # a sharded stage's whole parameters and gradients while it computes (engine/shards.py), at their most
        whole = self.stage.shards.whole_peak if self.stage.shards is not None else 0
        snap: dict[str, Any] = {**static, "static": sum(static.values()), "activations": ledger.peak,
                                "resident": ledger.resident_peak, "host": ledger.host_peak, "stash": stash,
                                "peak": sum(static.values()) + stash + ledger.peak + whole,
                                "budget": self.budget, **({"gathered": whole} if self.stage.shards is not None else {})}
        if self.placement.is_cuda:
            snap["cuda_allocated"] = torch.cuda.memory_allocated(self.placement.device)
            snap["cuda_peak"] = torch.cuda.max_memory_allocated(self.placement.device)
            torch.cuda.reset_peak_memory_stats(self.placement.device)
        return snap
