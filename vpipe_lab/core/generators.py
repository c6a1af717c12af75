"""The schedules vpipe_lab runs, built in the IR of ``core/schedule.py``: GPipe, 1F1B (and its eager variant),
zero-bubble ZB-H1 (``core/zero_bubble.py``), interleaved 1F1B over virtual stages (``core/interleaved.py``) and ZBV
(``core/zbv.py``) and PipeDream's 1F1B with weight stashing (``core/pipedream.py``), each expanded with its plan's
receives, sends, swaps and recomputes; ``for_plan`` picks a plan's."""

from __future__ import annotations

from dataclasses import replace

from vpipe_lab.core import interleaved, zbv, zero_bubble
from vpipe_lab.core.plan import Plan, Policy, placement
from vpipe_lab.core.schedule import Action, Op, Schedule, one_f_one_b_order


def _expand(order: list[tuple[Op, int, int]], chunks: int, plan: Plan | None,
            where: tuple[int, ...] = ()) -> tuple[Action, ...]:
    """Turn a row's (op, chunk, micro-batch) order of F, B and W into full actions: receives, sends, swaps (prefetched
    one step early), recompute. ``chunks``: the pipeline's chunks (virtual stages; one per row without them);
    ``where``: each chunk's row, where two neighbouring chunks can share one (ZBV's turn), whose hand-off is then
    local, with no transfer (``schedule.local``)."""
    def local(c: int, d: int) -> bool:
        return bool(where) and where[c] == where[d]

    swapped: dict[int, list[int]] = {}
    recomputed: dict[int, list[int]] = {}
    for c in {c for _, c, _ in order}:
        layers = plan.chunk_layers(c) if plan is not None else ()
        swapped[c] = [i for i in layers if plan is not None and plan.policies[i] is Policy.SWAP]
        recomputed[c] = [i for i in layers if plan is not None and plan.policies[i] is Policy.RECOMPUTE]
    out: list[Action] = []
    forwarded: set[tuple[int, int]] = set()
    for pos, (op, c, mb) in enumerate(order):
        if op is Op.F:
            forwarded.add((c, mb))
            if c > 0 and not local(c - 1, c):
                out.append(Action(c, Op.RECV_F, mb))
            out.append(Action(c, Op.F, mb))
            out.extend(Action(c, Op.SWAP_OUT, mb, i) for i in swapped[c])
            if c < chunks - 1 and not local(c, c + 1):
                out.append(Action(c, Op.SEND_F, mb))
        elif op is Op.B:
            if c < chunks - 1 and not local(c, c + 1):
                out.append(Action(c, Op.RECV_B, mb))
            out.extend(Action(c, Op.RECOMPUTE, mb, i) for i in reversed(recomputed[c]))
            out.append(Action(c, Op.B, mb))
            if c > 0 and not local(c - 1, c):
                out.append(Action(c, Op.SEND_B, mb))
        elif op is Op.W:
            out.append(Action(c, Op.W, mb))
            continue  # the weight step needs no activations: it neither prefetches nor is prefetched for
        # Prefetch: a backward's swap-ins are issued before the compute step that precedes it, so they overlap it.
        upcoming = [step for step in order[pos + 1:pos + 4] if step[0] is not Op.W][:2]
        if len(upcoming) == 2 and upcoming[1][0] is Op.B and (upcoming[1][1], upcoming[1][2]) in forwarded:
            _, c_next, mb_next = upcoming[1]
            out.extend(Action(c_next, Op.SWAP_IN, mb_next, i) for i in reversed(swapped[c_next]))
    # A backward right at the start of the list or right after another backward still needs its swap-ins.
    have = {(a.stage, a.microbatch, a.layer) for a in out if a.op is Op.SWAP_IN}
    fixed: list[Action] = []
    for a in out:
        if a.op is Op.B:
            fixed.extend(Action(a.stage, Op.SWAP_IN, a.microbatch, i) for i in reversed(swapped[a.stage])
                         if (a.stage, a.microbatch, i) not in have)
        fixed.append(a)
    return tuple(fixed)


def gpipe(stages: int, microbatches: int, plan: Plan | None = None) -> Schedule:
    """GPipe with a flush: every forward, then every backward, in micro-batch order."""
    rows = []
    for s in range(stages):
        order = [(Op.F, s, m) for m in range(microbatches)] + [(Op.B, s, m) for m in range(microbatches)]
        rows.append(_expand(order, stages, plan))
    return Schedule(tuple(rows), microbatches, "gpipe")


def one_f_one_b(stages: int, microbatches: int, plan: Plan | None = None, *, eager: bool = False) -> Schedule:
    """1F1B with a flush (PipeDream-Flush): K-s-1 warm-up forwards, alternate, then drain the backwards. ``eager``
    adds one warm-up forward on every stage but the last: in the steady state a stage's next forward input and its
    next gradient then arrive while it computes, instead of one transfer latency each way per micro-batch on the
    critical path (at the cost of one more micro-batch of activations on those stages)."""
    rows = []
    for s in range(stages):
        warm = min(stages - s - 1 + (1 if eager and s < stages - 1 else 0), microbatches)
        rows.append(_expand([(op, s, m) for op, m in one_f_one_b_order(warm, microbatches)], stages, plan))
    return Schedule(tuple(rows), microbatches, "eager-1f1b" if eager else "1f1b")


def zb_h1(stages: int, microbatches: int, plan: Plan | None = None) -> Schedule:
    """ZB-H1: 1F1B's memory, the backward split into B (input gradient) and W (weight gradients), the W steps placed
    into what would be bubbles (``core/zero_bubble.py``). The order is worked out with the paper's unit costs
    (F = B = W), a stage's B longer by the share of its layers it recomputes (each is a forward again)."""
    backward = [1.0] * stages
    if plan is not None:
        for s in range(stages):
            layers = plan.layers_of(s)
            backward[s] += sum(plan.policies[i] is Policy.RECOMPUTE for i in layers) / max(1, len(layers))
    rows = []
    for s, order in enumerate(zero_bubble.zb_h1_orders(stages, microbatches, backward=backward)):
        rows.append(_expand([(Op(op), s, mb) for op, mb in order], stages, plan))
    return Schedule(tuple(rows), microbatches, "zb-h1")


def interleaved_1f1b(stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> Schedule:
    """Interleaved 1F1B: ``virtual`` chunks per stage in looped placement (``core/interleaved.py``)."""
    chunks = stages * virtual
    rows = [_expand([(Op(op), c, mb) for op, c, mb in order], chunks, plan)
            for order in interleaved.orders(stages, virtual, microbatches)]
    return Schedule(tuple(rows), microbatches, "interleaved-1f1b", tuple(c % stages for c in range(chunks)))


def zbv_schedule(stages: int, microbatches: int, plan: Plan | None = None) -> Schedule:
    """ZBV: two chunks per stage in V placement, backward split into B and W (``core/zbv.py``); the last stage hands
    its first chunk's output to its second without a transfer."""
    where = placement("zbv", stages, 2 * stages)
    rows = [_expand([(Op(op), c, mb) for op, c, mb in order], 2 * stages, plan, where)
            for order in zbv.orders(stages, microbatches)]
    return Schedule(tuple(rows), microbatches, "zbv", where)


def for_plan(plan: Plan) -> Schedule:
    """The schedule a plan runs: its kind, stages and micro-batches, with its swaps and recomputes."""
    if plan.schedule == "gpipe":
        return gpipe(plan.stages, plan.microbatches, plan)
    if plan.schedule == "zb-h1":
        return zb_h1(plan.stages, plan.microbatches, plan)
    if plan.schedule == "interleaved-1f1b":
        return interleaved_1f1b(plan.stages, plan.virtual_stages, plan.microbatches, plan)
    if plan.schedule == "zbv":
        return zbv_schedule(plan.stages, plan.microbatches, plan)
    if plan.schedule == "pipedream":  # 1F1B's order; the runtime updates after each backward (core/pipedream.py)
        return replace(one_f_one_b(plan.stages, plan.microbatches, plan), name="pipedream")
    return one_f_one_b(plan.stages, plan.microbatches, plan, eager=plan.schedule == "eager-1f1b")
