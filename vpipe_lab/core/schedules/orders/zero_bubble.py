"""Zero-bubble schedule ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward split into
B (the input's gradient, which the previous stage waits for) and W (the weights' gradients, which nobody waits for),
and the W steps moved into the time a stage would otherwise sit waiting.

The order is built by list scheduling, as the paper's own scheduler does, with costs every rank can derive from the
plan alone (``schedule.zb_h1``: the paper's F = B = W, plus a recomputing stage's rebuild in its B) and free
transfers. Each stage, whenever it is free, runs:

1. the next B, if its output gradient has arrived (on the last stage: if its forward has run);
2. else the next F, if its input has arrived, the stage holds fewer than ``K - s`` micro-batches between their F and
   their B (1F1B's count, so full activations are held as in 1F1B) and fewer than ``max(K, K - s + 1)`` between
   their F and their W (``waiting_w``: the micro-batches beyond 1F1B's count wait only for their W, which keeps just
   their linear layers' inputs and output gradients);
3. else the oldest pending W;
4. else it waits for the next arrival.

In the steady state this is F-B-W as 1F1B runs F-(B+W); in the drain, when no forward is left, the W steps fill the
gaps between backwards that 1F1B leaves idle, and B reaches the previous stage one W earlier on every stage. With
equal stages the bubble shrinks from 1F1B's ``(K-1)(F+B+W)`` to the paper's ``(K-1)(F+B-W)`` (K = 4, M = 8, unit
costs: 33 -> 27 units; K = 8: 45 -> 31). The first stage may keep one W waiting beyond 1F1B's count: capped at that
count, it must finish a W before its next forward leaves, which puts every transfer's latency on the critical path;
on 2 CPU ranks (gloo) gpt-tiny ran 10% slower than 1F1B that way (``benchmarks/schedules.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Step = tuple[str, int]  # ("F" | "B" | "W", micro-batch)


def waiting_w(stages: int, stage: int) -> int:
    """How many micro-batches ``stage`` may hold between their forward and their weight step."""
    return max(stages, stages - stage + 1)


@dataclass
class _Lane:
    free_at: float = 0.0
    f: int = 0  # next forward
    b: int = 0  # next backward (input gradient)
    w: int = 0  # next weight gradient


def zb_h1_orders(stages: int, microbatches: int, forward: Sequence[float] = (), backward: Sequence[float] = (),
                 weight: Sequence[float] = ()) -> list[list[Step]]:
    """Each stage's order of F, B and W steps for one iteration of ZB-H1 (see the module docstring); the costs are
    per stage, 1 where not given."""
    k, m = stages, microbatches
    forward, backward, weight = (list(c) or [1.0] * k for c in (forward, backward, weight))
    lanes = [_Lane() for _ in range(k)]
    inputs: list[dict[int, float]] = [{} for _ in range(k)]  # stage -> micro-batch -> when its input arrived
    grads: list[dict[int, float]] = [{} for _ in range(k)]  # stage -> micro-batch -> when its output gradient did
    orders: list[list[Step]] = [[] for _ in range(k)]

    def may_forward(s: int) -> bool:
        """Another forward keeps the stage within its micro-batches in flight (see the module docstring)."""
        lane = lanes[s]
        return lane.f < m and lane.f - lane.b < k - s and lane.f - lane.w < waiting_w(k, s)

    def choice(s: int, now: float) -> str | None:
        lane = lanes[s]
        if lane.b < lane.f and (s == k - 1 or grads[s].get(lane.b, math.inf) <= now):
            return "B"
        if may_forward(s) and (s == 0 or inputs[s].get(lane.f, math.inf) <= now):
            return "F"
        if lane.w < lane.b:
            return "W"
        return None

    def ready_at(s: int) -> float:
        """When stage ``s`` can next act: now if it has work, else at the next known arrival (inf: unknown yet)."""
        lane = lanes[s]
        if choice(s, lane.free_at) is not None:
            return lane.free_at
        waits = []
        if lane.b < lane.f and s < k - 1 and lane.b in grads[s]:
            waits.append(grads[s][lane.b])
        if may_forward(s) and s > 0 and lane.f in inputs[s]:
            waits.append(inputs[s][lane.f])
        return max(lane.free_at, min(waits)) if waits else math.inf

    remaining = 3 * m * k
    while remaining:
        # The stage that can act earliest goes next, so every arrival before its time is already known.
        now, s = min((ready_at(s), s) for s in range(k))
        if now == math.inf:  # pragma: no cover - the rules above always leave some stage able to move
            raise RuntimeError(f"zero-bubble list scheduling stalled with {remaining} steps left")
        lane = lanes[s]
        op = choice(s, now)
        assert op is not None
        if op == "F":
            mb, cost = lane.f, forward[s]
            lane.f += 1
            if s < k - 1:
                inputs[s + 1][mb] = now + cost
        elif op == "B":
            mb, cost = lane.b, backward[s]
            lane.b += 1
            if s > 0:
                grads[s - 1][mb] = now + cost
        else:
            mb, cost = lane.w, weight[s]
            lane.w += 1
        lane.free_at = now + cost
        orders[s].append((op, mb))
        remaining -= 1
    return orders
