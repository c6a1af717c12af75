"""One training iteration of one stage: its row of the schedule walked action by action, one method per action kind.

The ``Executor`` (``executor.py``) prepares the stage for the iteration (loss scales, split backward, micro-batches)
and reads the result; a ``StageIteration`` holds what lives only within the iteration (tensors received, outputs
waiting to be sent, gradients, losses, receives posted ahead, the spans' marks) and runs the actions.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules.actions import KIND, Action, Op, Schedule, chunk_indices
from vpipe_lab.runtime.engine import faults
from vpipe_lab.runtime.engine.allocator import region
from vpipe_lab.runtime.engine.comm import TAG_BACKWARD, TAG_FORWARD, Incoming, Peer
from vpipe_lab.runtime.engine.device import Placement, Stopwatch
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.model.batches import to_device
from vpipe_lab.runtime.model.capture import Chain

LossFn = Callable[[Any, Any], torch.Tensor]
Step = tuple[int, int]  # (chunk, micro-batch)
Mark = tuple[str, int, int | None, float, float, int]  # kind, micro-batch, layer, start, end, chunk
COMM = (Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B)
_UNLABELLED = nullcontext()


def chunk_tag(base: int, chunk: int, plan: Plan) -> int:
    """``base`` (a ``TAG_*``) for transfers into ``chunk``: per chunk with virtual stages, since two ranks then
    exchange several chunks' tensors and each stream must stay in order."""
    return base if plan.virtual_stages == 1 else base + 8 * chunk


def tag_into(op: Op, chunk: int, plan: Plan) -> int:
    """The tag of a transfer into ``chunk``: its input for RECV_F, its output's gradient for RECV_B."""
    return chunk_tag(TAG_FORWARD if op in (Op.RECV_F, Op.SEND_F) else TAG_BACKWARD, chunk, plan)


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
    spans: list[Mark] = field(default_factory=list)
    violation: BudgetViolation | None = None
    sizes: list[int] | None = None  # samples per micro-batch: the losses' weights in the iteration's loss
    loss_sum: bool = False  # the losses are the micro-batches' shares of the batch's loss (counted items): sum them


class Host(Protocol):
    """What an iteration needs of the executor that runs it (``executor.Executor``)."""

    rank: int
    stage: Stage
    peer: Peer
    chain: Chain | None
    watch: Stopwatch
    placement: Placement
    record_spans: bool
    fault: Any
    action: Action | None  # the action running: a failure names it
    in_loss: bool

    def _plan(self, plan: Plan) -> tuple[Plan, Schedule, dict[int, Step | None], dict[Op, Step | None]]: ...

    def _check_budget(self, result: IterationResult) -> None: ...


class StageIteration:
    """One iteration of ``ex``'s stage under ``plan``: ``walk()`` runs the stage's row of actions."""

    def __init__(self, ex: Host, iteration: int, plan: Plan, inputs: list[Any] | None,
                 targets: list[Any] | None, loss_fn: LossFn, profile: bool, agreed: bool) -> None:
        self.ex, self.stage, self.peer, self.chain = ex, ex.stage, ex.peer, ex.chain
        self.iteration, self.plan, self.inputs, self.targets, self.loss_fn = iteration, plan, inputs, targets, loss_fn
        self.agreed = agreed  # shapes agreed once per epoch only when every micro-batch has them
        self.top, self.at = plan.chunks - 1, plan.placement  # chunk c (a virtual stage) runs on rank at[c]
        segments = self.stage.segments(profile, plan.boundaries[1:-1])  # no segment runs across two chunks
        self.segs = {c: [g for g in segments if plan.boundaries[c] <= g[0] < plan.boundaries[c + 1]]
                     for c in plan.chunks_of(ex.rank)}
        self.timer = ex.watch.exact if profile else None
        if profile and (shards := self.stage.shards) is not None:  # a layer's time leaves out the collectives
            exact = ex.watch.exact                                   # FSDP ran inside it (their own spans)
            self.timer = lambda: exact() - shards.busy_s
        self.received: dict[Step, Any] = {}
        self.outputs: dict[Step, Any] = {}
        self.grads_out: dict[Step, tuple[torch.Tensor, ...]] = {}
        self.grads_in: dict[Step, tuple[torch.Tensor, ...]] = {}
        self.losses: list[torch.Tensor] = []
        self.posted: dict[tuple[Op, int, int], Incoming] = {}
        self.marks: list[Mark] = []
        _, self.schedule, self.following, firsts = ex._plan(plan)
        self.row = self.schedule.stages[ex.rank]
        self.local = chunk_indices(self.schedule)  # a span names the stage's chunk by its index, as the simulator's
        self.result = IterationResult(iteration, ex.watch.begin(), 0.0)
        if self.peer.prepost and agreed:  # the first receive of each kind, when this shape epoch knows its shapes
            for op, first in firsts.items():
                if first is not None and self.peer.knows(*(source := self._source(op, first[0]))):
                    self.posted[(op, *first)] = self.peer.post_recv(*source, agreed=True)

    def walk(self) -> IterationResult:
        """Every action of the row in order, each timed onto a span; returns the result, its losses still tensors
        in ``self.losses``."""
        ex, stage, peer, mark = self.ex, self.stage, self.peer, self.ex.watch.mark
        # Labels only while a torch profiler records: entering a record_function per action costs ~3% of a small
        # model's iteration even when nothing listens (gpt-tiny, 2 CPU stages, benchmarks/interleaved.py).
        labelled = torch._C._autograd._profiler_enabled()
        for step, action in enumerate(self.row):
            op = action.op
            ex.action = action
            stage.at_units = None
            if op not in COMM:
                peer.issue()  # transfers queued by the actions before this one leave before it computes
            if op in (Op.RECV_B, Op.RECOMPUTE, Op.B):
                stage.ledger.in_backward = True  # from here on, working sets of the backward phase
            label = _UNLABELLED if not labelled else torch.profiler.record_function(
                f"vpipe/{KIND[op]} mb{action.microbatch}" if action.layer is None else
                f"vpipe/{KIND[op]} mb{action.microbatch} layer{action.layer}")
            with label:  # a recompute's label only marks its place: its layer is rebuilt in B (``backward``)
                if op is Op.RECOMPUTE:
                    continue  # vPipe's order: each layer is rebuilt right before its own backward
                start = ACTIONS[op](self, step, action, mark())
                if ex.record_spans:
                    self.marks.append((KIND[op], action.microbatch, action.layer, start, mark(),
                                       self.local[action.stage]))
                self._drain(action.microbatch, action.stage)  # a sharded stage's collectives inside the action
        ex.action = None
        peer.flush()
        self.finish()
        return self.result

    # --- transfers -----------------------------------------------------------------------------------------------
    def _source(self, op: Op, c: int) -> tuple[int, int]:
        """Who sends into chunk ``c`` and with which tag: its input from chunk c-1, its gradient from c+1."""
        return (self.at[c - 1] if op is Op.RECV_F else self.at[c + 1]), tag_into(op, c, self.plan)

    def _receive(self, step: int, op: Op, c: int, mb: int) -> Any:
        peer = self.peer
        inc = self.posted.pop((op, c, mb), None) or peer.post_recv(*self._source(op, c), agreed=self.agreed)
        value = peer.wait(inc)
        nxt = self.following[step]
        if nxt is not None and self.agreed and peer.prepost:  # post the next one ahead, when its shapes are known
            src, tag = self._source(op, nxt[0])
            if peer.knows(src, tag):
                self.posted[(op, *nxt)] = peer.post_recv(src, tag, agreed=True)
        return value

    def receive_input(self, step: int, action: Action, start: float) -> float:
        c, mb = action.stage, action.microbatch
        got = self._receive(step, Op.RECV_F, c, mb)
        self.received[(c, mb)] = self.chain.unpack(self.plan.boundaries[c] - 1, got) if self.chain is not None else (
            got[0] if isinstance(got, tuple) and len(got) == 1 else got)
        return start

    def send_output(self, step: int, action: Action, start: float) -> float:
        c, mb = action.stage, action.microbatch
        out = self.outputs.pop((c, mb))
        self.peer.post_send(self.chain.pack(out) if self.chain is not None else out, self.at[c + 1],
                            tag_into(Op.RECV_F, c + 1, self.plan), agreed=self.agreed)
        return start

    def receive_gradient(self, step: int, action: Action, start: float) -> float:
        self.grads_out[(action.stage, action.microbatch)] = self._receive(step, Op.RECV_B, action.stage,
                                                                          action.microbatch)
        return start

    def send_gradient(self, step: int, action: Action, start: float) -> float:
        c, mb = action.stage, action.microbatch
        self.peer.post_send(self.grads_in.pop((c, mb)), self.at[c - 1], tag_into(Op.RECV_B, c - 1, self.plan),
                            agreed=self.agreed)
        return start

    # --- compute -------------------------------------------------------------------------------------------------
    def forward(self, step: int, action: Action, start: float) -> float:
        ex, stage, c, mb = self.ex, self.stage, action.stage, action.microbatch
        if ex.fault is not None:
            faults.hit(ex.fault, "forward", ex.rank, self.iteration)
        if stage.stash.on:
            stage.stash.begin(mb, stage.params())
        if c > 0:  # handed over in place from the chunk before, when it runs here too
            x = self.outputs.pop((c - 1, mb)) if self.schedule.local(c - 1, c) else self.received.pop((c, mb))
        else:
            x = to_device(self.inputs[mb], ex.placement.device)  # type: ignore[index]
            x = self.chain.start(x) if self.chain is not None else x
        if stage.shards is not None:  # a sharded stage gathers the chunk's parameters first (engine/shards.py)
            start = self._gather(c, mb, start)
        for segment in self.segs[c]:  # the pipeline's data input needs no gradient
            with region(f"f/{segment[0]}"):  # what it allocates, where the allocator is measured (allocator.py)
                x = stage.forward(mb, segment, x, input_grad=c > 0 or segment[0] > 0, timer=self.timer)
            ex._check_budget(self.result)
        if c == self.top:
            target = to_device(self.targets[mb], ex.placement.device)  # type: ignore[index]
            ex.in_loss = True
            with region(f"l/{self.segs[c][-1][-1]}"):
                self.losses.append(stage.attach_loss(mb, self.segs[c][-1], x, self.loss_fn, target, self.timer))
            ex.in_loss = False
        else:
            self.outputs[(c, mb)] = x
        return start

    def backward(self, step: int, action: Action, start: float) -> float:
        """B over the chunk's segments, last first; a recomputed segment is rebuilt right before its own backward
        (its own "recompute" span, between the backward's pieces). Returns where the last piece began."""
        ex, stage, c, mb = self.ex, self.stage, action.stage, action.microbatch
        mark = ex.watch.mark
        grads: tuple[torch.Tensor, ...] | None = None if c == self.top else self.grads_out.pop((c, mb)) if (
            not self.schedule.local(c, c + 1)) else self.grads_in.pop((c + 1, mb))
        for segment in reversed(self.segs[c]):
            if stage.rebuilds(mb, segment):  # held only until its backward: one recomputed layer at a time
                if ex.record_spans:
                    self.marks.append((KIND[Op.B], mb, None, start, (start := mark()), self.local[c]))
                with region(f"r/{segment[0]}"):
                    stage.rematerialise(mb, segment, self.timer)
                ex._check_budget(self.result)
                if ex.record_spans:
                    self.marks.append(("recompute", mb, segment[0], start, (start := mark()), self.local[c]))
            with region(f"b/{segment[0]}"):
                grads = stage.backward(mb, segment, grads, self.timer, self.local[c])
        if c > 0:
            self.grads_in[(c, mb)] = grads  # type: ignore[assignment]
        if stage.stash.on:
            stage.update(mb)
        if stage.shards is not None and not self.plan.kind.split_backward:  # the micro-batch's backward is whole
            self._reduce(c, mb)
        return start

    def weight_step(self, step: int, action: Action, start: float) -> float:
        self.stage.weight_step(action.microbatch, self.timer, self.local[action.stage])
        if self.stage.shards is not None:  # a split backward's micro-batch is whole once its W has run
            self._reduce(action.stage, action.microbatch)
        return start

    # --- a sharded stage's collectives (engine/shards.py) ------------------------------------------------------------
    def _units(self, c: int) -> list[int]:
        return [i for segment in self.segs[c] for i in segment]

    def _gather(self, c: int, mb: int, start: float) -> float:
        """All-gather chunk ``c``'s parameters where the stage keeps them gathered (its span: ``_drain``); returns
        where the forward's own work begins."""
        shards = self.stage.shards
        assert shards is not None
        with region(f"g/{c}"):
            gathered = shards.gather(self._units(c))
        if gathered:
            self._drain(mb, c)
            return self.ex.watch.mark()
        return start

    def _reduce(self, c: int, mb: int) -> None:
        """Chunk ``c``'s backward of micro-batch ``mb`` is complete: reduce-scatter as the stage's sharding says."""
        shards = self.stage.shards
        assert shards is not None
        with region(f"s/{c}"):
            shards.after_backward(self._units(c))
        self._drain(mb, c)

    def _drain(self, mb: int, c: int) -> None:
        """The collectives FSDP ran since the last drain (its own, in a forward or backward, and the executor's), as
        spans of the micro-batch and chunk they served (``engine/shards.py`` times them)."""
        shards = self.stage.shards
        if shards is None or not shards.spans:
            return
        if self.ex.record_spans:
            for kind, unit, begin, end in shards.spans:
                self.marks.append((kind, mb, unit if unit >= 0 else None, begin, end, self.local[c]))
        shards.spans.clear()

    def finish(self) -> None:
        """After the row: a sharded stage reduce-scatters what it held for the iteration and reshards."""
        shards = self.stage.shards
        if shards is None:
            return
        with region("s/end"):
            shards.finish()
        self._drain(self.plan.microbatches - 1, self.plan.chunks_of(self.ex.rank)[-1])


    # --- memory --------------------------------------------------------------------------------------------------
    def swap_out(self, step: int, action: Action, start: float) -> float:
        if action.layer in self.stage.layers:
            self.stage.swap.swap_out(action.microbatch, action.layer)
        return start

    def swap_in(self, step: int, action: Action, start: float) -> float:
        if action.layer in self.stage.layers:
            self.stage.swap.swap_in(action.microbatch, action.layer)
        return start


# What each action does, as plain functions of the iteration: a table of its bound methods kept on the iteration
# would make a reference cycle per iteration, and the iteration's tensors would wait for a full garbage collection
# (``benchmarks/flat_memory.py --heap`` found them there).
ACTIONS: dict[Op, Callable[[StageIteration, int, Action, float], float]] = {
    Op.RECV_F: StageIteration.receive_input, Op.F: StageIteration.forward, Op.SEND_F: StageIteration.send_output,
    Op.SWAP_OUT: StageIteration.swap_out, Op.SWAP_IN: StageIteration.swap_in,
    Op.RECV_B: StageIteration.receive_gradient, Op.B: StageIteration.backward, Op.W: StageIteration.weight_step,
    Op.SEND_B: StageIteration.send_gradient}
