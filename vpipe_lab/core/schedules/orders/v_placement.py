"""ZBV (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, its ZB-V schedule): two chunks per rank in V
placement, the backward split into B (input gradient) and W (weight gradients) as in ZB-H1.

Rank ``r`` of ``K`` holds chunk ``r`` (on the way down) and chunk ``2K - 1 - r`` (on the way back up), so the last
rank hands its first chunk's output to its second without a transfer, and the loss is computed on rank 0, which
also reads the inputs. Every rank then holds the same share of the model's activations: the first rank's 1F1B
peak (``K`` micro-batches of a stage, i.e. ``2K`` chunk-forwards) where 1F1B's falls from ``K`` to 1 along the
pipeline, and the bubble nearly closes: the up chunk's forwards fill the down chunk's warm-up, its W steps fill the
drain.

Each rank runs, with ``a`` its down chunk and ``b`` its up chunk (the paper's order):

1. warm-up: ``2 (K - r) - 1`` forwards of ``a``, then ``r`` pairs (F ``b``, F ``a``), then ``K - r`` triples
   (F ``b``, B ``b``, W ``b``): the first backwards reach the rank as its up chunk's first gradients arrive;
2. steady state: (F ``a``, B ``a``, W ``a``, F ``b``, B ``b``, W ``b``) until every forward has run;
3. drain: ``r`` pairs (B ``a``, B ``b``), then B ``a`` and a deferred W alternately, then the W steps left.

Every step is taken only when it exists (its micro-batch count not reached, its B before it), so fewer micro-batches
than the warm-up's ``2K - 1`` still give a valid, if bubbly, order.
"""

from __future__ import annotations

import functools

from vpipe_lab.core.errors import ScheduleError
from vpipe_lab.core.schedules.orders.held import states

Step = tuple[str, int, int]  # ("F" | "B" | "W", chunk, micro-batch)


def chunks_of(ranks: int, rank: int) -> tuple[int, int]:
    """The two chunks ``rank`` holds, in model order (``plan.placement`` maps them back)."""
    return rank, 2 * ranks - 1 - rank


class _Counts:
    """How many F, B and W steps of each of a rank's two chunks the order holds so far."""

    def __init__(self, rank: int, ranks: int, microbatches: int) -> None:
        self.chunks = chunks_of(ranks, rank)
        self.m = microbatches
        self.done = {(op, i): 0 for op in "FBW" for i in (0, 1)}
        self.order: list[Step] = []

    def can(self, op: str, i: int) -> bool:
        n = self.done[(op, i)]
        before = {"F": self.m, "B": self.done[("F", i)], "W": self.done[("B", i)]}[op]
        return n < before

    def take(self, op: str, i: int) -> bool:
        if not self.can(op, i):
            return False
        self.order.append((op, self.chunks[i], self.done[(op, i)]))
        self.done[(op, i)] += 1
        return True


def orders(ranks: int, microbatches: int) -> list[list[Step]]:
    """Each rank's order of chunk F, B and W steps for one iteration (see the module docstring)."""
    k, m = ranks, microbatches
    if k < 1 or m < 1:
        raise ScheduleError(f"ZBV needs at least one rank and one micro-batch, got {k} ranks and {m} micro-batches")
    out = []
    for r in range(k):
        n = _Counts(r, k, m)
        a, b = 0, 1
        for _ in range(2 * (k - r) - 1):
            n.take("F", a)
        for _ in range(r):
            n.take("F", b)
            n.take("F", a)
        for _ in range(k - r):
            n.take("F", b)
            n.take("B", b)
            n.take("W", b)
        while n.can("F", a) or n.can("F", b):
            n.take("F", a)
            n.take("B", a)
            n.take("W", a)
            n.take("F", b)
            n.take("B", b)
            n.take("W", b)
        for _ in range(r):
            n.take("B", a)
            n.take("B", b)
        while n.can("B", a) or n.can("B", b):
            took = n.take("B", a)
            n.take("W", a) if took else n.take("B", b)
        for i in (b, a):
            while n.take("W", i):
                pass
        out.append(n.order)
    return out


@functools.cache
def held(ranks: int, microbatches: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """What ``rank`` holds along its order (``held.py``): forwards awaiting B and backwards awaiting W of its
    first and second chunk, and the chunk whose B comes next (-1: none)."""
    return states(orders(ranks, microbatches)[rank], chunks_of(ranks, rank))
