"""DualPipeV (DeepSeek-V3's DualPipe folded into a V, torch's ``ScheduleDualPipeV``): two chunks per stage in V
placement, the steady state pairing one chunk's forward with the other chunk's backward of another micro-batch.

Stage ``r`` of ``K`` holds chunk ``r`` (on the way down) and chunk ``2K - 1 - r`` (on the way up). Its order, in
eight phases: ``2 (K - r - 1)`` forwards of its down chunk; ``r + 1`` pairs of forwards (down, up); ``K - r - 1``
rounds of an up chunk's input gradient, a pending weight step and an up forward (zero-bubble style); the main phase,
``M - 2K + r + 1`` rounds of (down forward with an up backward) and (up forward with a down backward), each backward
whole; ``K - r - 1`` rounds of an up backward and (up forward with a down backward); ``r + 1`` rounds of an up and a
down backward, the second half of them split into input gradient and a later weight step; ``K - r - 1`` rounds of a
pending weight step and a down backward; and the pending weight steps. The paired forward and backward are what the
schedule overlaps on a GPU (one's communication under the other's compute); here they run one after the other, which
is the same arithmetic.

In the lab's IR the backward is split (B: the input's gradient, W: the weights'); a *whole* backward is a B followed at
once by its W (``full_backwards`` names them, so the export writes torch's ``B`` for them).
"""

from __future__ import annotations

import functools

from vpipe_lab.core.schedules.actions import Op
from vpipe_lab.core.schedules.kind import ScheduleKind, Step, TorchSchedule
from vpipe_lab.core.schedules.plan_view import PlanView as Plan
from vpipe_lab.core.schedules.zbv import ZBV


class _Row:
    """One stage's order as it is written: per-chunk counters of forwards and backwards, weight steps pending."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.forwards: dict[int, int] = {}
        self.backwards: dict[int, int] = {}
        self.pending: list[tuple[int, int]] = []  # (chunk, micro-batch) of input gradients awaiting their W, oldest first
        self.whole: set[tuple[int, int]] = set()

    def forward(self, chunk: int) -> None:
        mb = self.forwards.get(chunk, 0)
        self.forwards[chunk] = mb + 1
        self.steps.append((Op.F, chunk, mb))

    def backward(self, chunk: int, whole: bool) -> None:
        mb = self.backwards.get(chunk, 0)
        self.backwards[chunk] = mb + 1
        self.steps.append((Op.B, chunk, mb))
        if whole:  # the weights' gradients right away: one backward
            self.steps.append((Op.W, chunk, mb))
            self.whole.add((chunk, mb))
        else:
            self.pending.append((chunk, mb))

    def weight_step(self) -> None:
        if self.pending:
            chunk, mb = self.pending.pop(0)
            self.steps.append((Op.W, chunk, mb))


@functools.cache
def _rows(stages: int, microbatches: int) -> tuple[tuple[tuple[Step, ...], ...], frozenset[tuple[int, int]]]:
    """Every stage's order, and the (chunk, micro-batch) whose backward is whole (not split around other steps)."""
    k, m = stages, microbatches
    out, whole = [], set()
    for r in range(k):
        down, up = r, 2 * k - 1 - r
        row = _Row()
        for _ in range(2 * (k - r - 1)):
            row.forward(down)
        for _ in range(r + 1):
            row.forward(down)
            row.forward(up)
        for _ in range(k - r - 1):
            row.backward(up, whole=False)
            row.weight_step()
            row.forward(up)
        for _ in range(m - 2 * k + r + 1):
            row.forward(down)  # (the last stage's first round is not overlapped in torch's: the same order here)
            row.backward(up, whole=True)
            row.forward(up)
            row.backward(down, whole=True)
        for _ in range(k - r - 1):
            row.backward(up, whole=True)
            row.forward(up)
            row.backward(down, whole=True)
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            row.backward(up, whole=not split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            row.backward(down, whole=not split)
        for _ in range(k - r - 1):
            row.weight_step()
            row.backward(down, whole=not split)
        for _ in range(r + 1):
            row.weight_step()
        out.append(tuple(row.steps))
        whole |= row.whole
    return tuple(out), frozenset(whole)


class DualPipeV(ScheduleKind):
    name = "dualpipev"
    summary = "DeepSeek-V3's DualPipe in a V: two chunks per stage, one's forward paired with the other's backward"
    chunked = True
    virtual_choices = (2,)
    split_backward = True
    torch = TorchSchedule("DualPipeV", "v", lambda k, v, m: m >= 2 * k,
                          "the same order (torch's overlapped forward-backward pairs run one after the other)")

    def placement(self, stages: int, chunks: int) -> tuple[int, ...]:
        return ZBV().placement(stages, chunks)

    def orders(self, stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> list[list[Step]]:
        return [list(row) for row in _rows(stages, microbatches)[0]]

    def check(self, stages: int, microbatches: int) -> str | None:
        if microbatches < 2 * stages:
            return (f"dualpipev needs at least as many micro-batches as chunks (2 x {stages} stages = {2 * stages}), "
                    f"not microbatches={microbatches}")
        return None

    def auto_virtuals(self, stages: int, layers: int, microbatches: int | None) -> tuple[int, ...]:
        if microbatches is None or microbatches < 2 * stages or 2 * stages > layers:
            return ()
        return (2,)

    def full_backwards(self, stages: int, microbatches: int) -> frozenset[tuple[int, int]]:
        """The (chunk, micro-batch) whose backward is whole: its B and W adjacent, torch's ``B``."""
        return _rows(stages, microbatches)[1]
