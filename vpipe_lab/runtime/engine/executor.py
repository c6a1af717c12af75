"""Runs one iteration of a stage: walks its row of the core schedule IR, timing every action onto a span.

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

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedule import KIND, Action, Op, Schedule, chunk_indices
from vpipe_lab.core.schedules.builders import for_plan
from vpipe_lab.runtime.engine import faults
from vpipe_lab.runtime.engine.comm import TAG_BACKWARD, TAG_EVAL, TAG_FORWARD, Incoming, Peer
from vpipe_lab.runtime.engine.device import Clock, Placement, Stopwatch
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.model import counting
from vpipe_lab.runtime.model.batches import loss_with_check, split, to_device
from vpipe_lab.runtime.model.capture import Chain, for_inference

LossFn = Callable[[Any, Any], torch.Tensor]
Step = tuple[int, int]  # (chunk, micro-batch)


def chunk_tag(base: int, chunk: int, plan: Plan) -> int:
    """``base`` (a ``TAG_*``) for transfers into ``chunk``: per chunk with virtual stages, since two ranks then
    exchange several chunks' tensors and each stream must stay in order."""
    return base if plan.virtual_stages == 1 else base + 8 * chunk


def tag_into(op: Op, chunk: int, plan: Plan) -> int:
    """The tag of a transfer into ``chunk``: its input for RECV_F, its output's gradient for RECV_B."""
    return chunk_tag(TAG_FORWARD if op in (Op.RECV_F, Op.SEND_F) else TAG_BACKWARD, chunk, plan)

_COMM = (Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B)
_UNLABELLED = nullcontext()


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


@dataclass
class BudgetViolation:
    stage: int
    used_bytes: int
    budget_bytes: int
    layers: list[tuple[int, int]]  # (layer, resident bytes) of kept layers, largest first


@dataclass
class IterationResult:
    iteration: int
    start_s: float
    end_s: float
    losses: list[float] = field(default_factory=list)
    spans: list[tuple[str, int, int | None, float, float, int]] = field(default_factory=list)  # ..., chunk
    violation: BudgetViolation | None = None
    sizes: list[int] | None = None  # samples per micro-batch: the losses' weights in the iteration's loss
    loss_sum: bool = False  # the losses are the micro-batches' shares of the batch's loss (counted items): sum them


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
        rank, last = self.rank, self.rank == plan.loss_stage
        m = plan.microbatches
        self.in_loss = False
        stage, peer = self.stage, self.peer
        stage.stash.on = plan.kind.asynchronous  # PipeDream: an update after every backward (stash.py)
        stage.stash.reset()
        # each micro-batch's mean loss is a step of its own under PipeDream; else 1/M of the iteration's step
        stage.loss_scale = self.loss_multiplier / (1 if stage.stash.on else m)
        uneven = sizes is not None and len(sizes) == m and len(set(sizes)) > 1
        stage.scales = [self.loss_multiplier * (n / sum(sizes)) for n in sizes] if (
            uneven and sizes and not stage.stash.on) else None
        loss_fn, weights = self._counted(plan, batch, counts)
        if weights is not None:
            stage.scales = [self.loss_multiplier * w for w in weights]
        agreed = not uneven  # shapes agreed once per epoch only when every micro-batch has them
        stage.iteration = iteration
        stage.split_backward(plan.kind.split_backward)  # B then W (core/schedules/orders/zero_bubble.py), or one backward
        stage.ledger.reset_peaks()
        if self.budget is not None:
            static = stage.static_bytes()  # not ``sizes``: that name is the micro-batches' samples, reported below
            self._param_bytes = static["params"]
            self._static = sum(static.values())
        inputs = targets = None
        if batch is not None:
            if rank == 0:
                inputs = split(batch[0], m, "inputs")
            if last:
                targets = [None] * m if batch[1] is None else split(batch[1], m, "targets")
        chain = self.chain
        top, at = plan.chunks - 1, plan.placement  # chunk c (a virtual stage) runs on rank at[c]
        segments = stage.segments(profile, plan.boundaries[1:-1])  # no segment runs across two chunks
        segs = {c: [g for g in segments if plan.boundaries[c] <= g[0] < plan.boundaries[c + 1]] for c in
                plan.chunks_of(rank)}
        timer = self.watch.exact if profile else None
        received: dict[Step, Any] = {}
        outputs: dict[Step, Any] = {}
        grads_out: dict[Step, tuple[torch.Tensor, ...]] = {}
        grads_in: dict[Step, tuple[torch.Tensor, ...]] = {}
        losses: list[torch.Tensor] = []
        posted: dict[tuple[Op, int, int], Incoming] = {}
        _, schedule, following, firsts = self._plan(plan)
        row = schedule.stages[rank]

        def where(op: Op, c: int) -> tuple[int, int]:
            """Who sends into chunk ``c`` and with which tag: its input from chunk c-1, its gradient from c+1."""
            return (at[c - 1] if op is Op.RECV_F else at[c + 1]), tag_into(op, c, plan)

        def receive(step: int, op: Op, c: int, mb: int) -> Any:
            src, tag = where(op, c)
            inc = posted.pop((op, c, mb), None) or peer.post_recv(src, tag, agreed=agreed)
            value = peer.wait(inc)
            nxt = following[step]
            if nxt is not None and agreed and peer.prepost:  # post the next one ahead, when its shapes are known
                src, tag = where(op, nxt[0])
                if peer.knows(src, tag):
                    posted[(op, *nxt)] = peer.post_recv(src, tag, agreed=True)
            return value

        if peer.prepost and agreed:  # the first receive of each kind, when this shape epoch knows its shapes
            for op, first in firsts.items():
                if first is not None and peer.knows(*(source := where(op, first[0]))):
                    posted[(op, *first)] = peer.post_recv(*source, agreed=True)
        mark = self.watch.mark
        marks: list[tuple[str, int, int | None, float, float, int]] = []
        local = chunk_indices(schedule)  # a span names the stage's chunk by its index, as the simulator's do
        # Labels only while a torch profiler records: entering a record_function per action costs ~3% of a small
        # model's iteration even when nothing listens (gpt-tiny, 2 CPU stages, benchmarks/interleaved.py).
        labelled = torch._C._autograd._profiler_enabled()
        result = IterationResult(iteration, self.watch.begin(), 0.0)
        for step, action in enumerate(row):
            op, mb, c = action.op, action.microbatch, action.stage
            self.action = action
            stage.at_units = None
            if op not in _COMM:
                peer.issue()  # transfers queued by the actions before this one leave before it computes
            if op in (Op.RECV_B, Op.RECOMPUTE, Op.B):
                stage.ledger.in_backward = True  # from here on, working sets of the backward phase
            label = _UNLABELLED if not labelled else torch.profiler.record_function(
                f"vpipe/{KIND[op]} mb{mb}" if action.layer is None else f"vpipe/{KIND[op]} mb{mb} layer{action.layer}")
            label.__enter__()
            start = mark()
            if op is Op.RECV_F:
                got = receive(step, op, c, mb)
                received[(c, mb)] = chain.unpack(plan.boundaries[c] - 1, got) if chain is not None else (
                    got[0] if isinstance(got, tuple) and len(got) == 1 else got)
            elif op is Op.F:
                if self.fault is not None:
                    faults.hit(self.fault, "forward", rank, iteration)
                if stage.stash.on:
                    stage.stash.begin(mb, stage.params())
                if c > 0:  # handed over in place from the chunk before, when it runs here too
                    x = outputs.pop((c - 1, mb)) if schedule.local(c - 1, c) else received.pop((c, mb))
                else:
                    x = to_device(inputs[mb], self.placement.device)  # type: ignore[index]
                    x = chain.start(x) if chain is not None else x
                for segment in segs[c]:  # the pipeline's data input needs no gradient
                    x = stage.forward(mb, segment, x, input_grad=c > 0 or segment[0] > 0, timer=timer)
                    self._check_budget(result)
                if c == top:
                    target = to_device(targets[mb], self.placement.device)  # type: ignore[index]
                    self.in_loss = True
                    losses.append(stage.attach_loss(mb, segs[c][-1], x, loss_fn, target, timer))
                    self.in_loss = False
                else:
                    outputs[(c, mb)] = x
            elif op is Op.SEND_F:
                out = outputs.pop((c, mb))
                peer.post_send(chain.pack(out) if chain is not None else out, at[c + 1],
                               tag_into(Op.RECV_F, c + 1, plan), agreed=agreed)
            elif op is Op.SWAP_OUT:
                if action.layer in stage.layers:
                    stage.swap.swap_out(mb, action.layer)
            elif op is Op.SWAP_IN:
                if action.layer in stage.layers:
                    stage.swap.swap_in(mb, action.layer)
            elif op is Op.RECV_B:
                grads_out[(c, mb)] = receive(step, op, c, mb)
            elif op is Op.RECOMPUTE:
                label.__exit__(None, None, None)
                continue  # vPipe's order: each layer is rebuilt in B, right before its own backward (below)
            elif op is Op.B:
                grads: tuple[torch.Tensor, ...] | None = None if c == top else grads_out.pop((c, mb)) if (
                    not schedule.local(c, c + 1)) else grads_in.pop((c + 1, mb))
                for segment in reversed(segs[c]):
                    if stage.rebuilds(mb, segment):  # held only until its backward: one recomputed layer at a time
                        if self.record_spans:
                            marks.append((KIND[op], mb, None, start, (start := mark()), local[c]))
                        stage.rematerialise(mb, segment, timer)
                        self._check_budget(result)
                        if self.record_spans:
                            marks.append(("recompute", mb, segment[0], start, (start := mark()), local[c]))
                    grads = stage.backward(mb, segment, grads, timer, local[c])
                if c > 0:
                    grads_in[(c, mb)] = grads  # type: ignore[assignment]
                if stage.stash.on:
                    stage.update(mb)
            elif op is Op.W:
                stage.weight_step(mb, timer, local[c])
            elif op is Op.SEND_B:
                peer.post_send(grads_in.pop((c, mb)), at[c - 1], tag_into(Op.RECV_B, c - 1, plan), agreed=agreed)
            if self.record_spans:
                marks.append((KIND[op], mb, action.layer, start, mark(), local[c]))
            label.__exit__(None, None, None)
        self.action = None
        peer.flush()
        result.end_s = self.watch.end()
        seconds = self.watch.seconds
        result.spans = [(kind, mb, layer, seconds(a), seconds(b), c) for kind, mb, layer, a, b, c in marks]
        result.losses = [float(v) for v in losses]
        if weights is not None and losses:  # each micro-batch's share of the batch's loss: the iteration's is their sum
            result.losses = [v * w for v, w in zip(result.losses, weights)]
            result.loss_sum = True
        result.sizes = list(sizes) if sizes is not None else None
        return result

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
        try:
            with torch.no_grad():
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
        snap: dict[str, Any] = {**static, "static": sum(static.values()), "activations": ledger.peak,
                                "resident": ledger.resident_peak, "host": ledger.host_peak, "stash": stash,
                                "peak": sum(static.values()) + stash + ledger.peak,
                                "budget": self.budget}
        if self.placement.is_cuda:
            snap["cuda_allocated"] = torch.cuda.memory_allocated(self.placement.device)
            snap["cuda_peak"] = torch.cuda.max_memory_allocated(self.placement.device)
            torch.cuda.reset_peak_memory_stats(self.placement.device)
        return snap
