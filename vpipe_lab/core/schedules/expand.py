"""A row's order of compute steps expanded into the full IR: receives, sends, swaps (prefetched) and recomputes."""

from __future__ import annotations

from vpipe_lab.core.policy import Policy
from vpipe_lab.core.schedules.actions import Action, Op
from vpipe_lab.core.schedules.plan_view import PlanView as Plan


def expand(order: list[tuple[Op, int, int]], chunks: int, plan: Plan | None,
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
