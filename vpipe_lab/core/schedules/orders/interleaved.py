"""Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM's virtual pipeline stages): each of K ranks holds V model
chunks in looped placement (chunk ``c`` on rank ``c % K``), so a micro-batch crosses every rank V times and the
bubble shrinks from 1F1B's ``(K-1)/(M+K-1)`` to about ``(K-1)/(V M + K - 1)``, for V times the transfers.

Each rank runs its chunk-forwards in groups of K micro-batches per chunk (forward ``i`` is micro-batch
``(i // (K V)) K + i % K`` of chunk ``(i // K) % V`` of the rank's chunks), its chunk-backwards in the same groups with
the chunks reversed, ``(K - r - 1) 2 + (V - 1) K`` forwards of warm-up on rank ``r``, then one forward and one
backward alternately, then the remaining backwards: Megatron-LM's order. M must be a multiple of K.
"""

from __future__ import annotations

import functools

from vpipe_lab.core.errors import ScheduleError
from vpipe_lab.core.schedules.actions import one_f_one_b_order
from vpipe_lab.core.schedules.orders.held import states

Step = tuple[str, int, int]  # ("F" | "B", chunk, micro-batch)


def _step(op: str, i: int, rank: int, ranks: int, virtual: int) -> Step:
    group = i // ranks
    local = group % virtual if op == "F" else virtual - 1 - group % virtual
    return op, local * ranks + rank, (i // (ranks * virtual)) * ranks + i % ranks


def orders(ranks: int, virtual: int, microbatches: int) -> list[list[Step]]:
    """Each rank's order of chunk-forwards and chunk-backwards for one iteration (see the module docstring)."""
    k, v, m = ranks, virtual, microbatches
    if m % k:
        raise ScheduleError(f"interleaved 1F1B runs micro-batches in groups of the {k} ranks: {m} micro-batches is "
                            f"not a multiple of {k}; use {((m + k - 1) // k) * k} (or {max(k, m // k * k)})")
    total = m * v
    out = []
    for r in range(k):
        warmup = min((k - r - 1) * 2 + (v - 1) * k, total)
        out.append([_step(op, i, r, k, v) for op, i in one_f_one_b_order(warmup, total)])
    return out


@functools.cache
def peak_inflight(ranks: int, virtual: int, microbatches: int, rank: int) -> int:
    """The most chunk-forwards ``rank`` holds before their backward, at once (each keeps its chunk's activations)."""
    return max(sum(h[:virtual]) for h in held(ranks, virtual, microbatches, rank))


@functools.cache
def held(ranks: int, virtual: int, microbatches: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """What ``rank`` holds along its order (``held.py``): chunk-forwards awaiting their backward per chunk (in
    model order), and the chunk whose backward comes next (-1: none)."""
    return states(orders(ranks, virtual, microbatches)[rank], tuple(range(rank, ranks * virtual, ranks)))
