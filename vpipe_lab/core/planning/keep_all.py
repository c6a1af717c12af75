"""PipeDream's planner: the partition with the smallest bottleneck stage that fits with every activation kept."""

from __future__ import annotations

import math

from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.planning.partition import Objective, pareto_dp
from vpipe_lab.core.schedules.kind import BOTTLENECK


def partition(cm: CostModel) -> tuple[tuple[int, ...] | None, int]:
    """The min-bottleneck everything-kept partition under ``cm``'s schedule and budgets (None when none fits, by the
    estimate's own peak), and the search's transitions. Under the ``pipedream`` schedule the budget also pays for
    the stashed weights."""
    def stage_fn(s: int, lo: int, hi: int) -> tuple[float, float] | None:
        if cm.keep_peak_bytes(s, lo, hi) > cm.budget(s):
            return None
        return cm.base_times(s, lo, hi)

    seed = cover(cm)
    upper = math.inf
    if seed is not None:
        upper = max(sum(cm.base_times(s, seed[s], seed[s + 1])) for s in range(cm.stages)) * (1 + 1e-9)
    result = pareto_dp(cm.num_layers, cm.stages, stage_fn, cm.compute_prefix, Objective(BOTTLENECK), upper)
    return result.boundaries, result.transitions


def cover(cm: CostModel) -> tuple[int, ...] | None:
    """A feasible everything-kept partition with a small bottleneck, to bound PipeDream's exact search: bisect on the
    stage-time cap, filling each stage as far as both the cap and its memory allow."""
    n, k = cm.num_layers, cm.stages

    def fill(cap: float) -> tuple[int, ...] | None:
        bounds = [0]
        for s in range(k):
            lo = bounds[-1]
            last = n if s == k - 1 else n - (k - s - 1)
            hi = lo + 1 if s < k - 1 else n
            while hi < last and sum(cm.base_times(s, lo, hi + 1)) <= cap and \
                    cm.keep_peak_bytes(s, lo, hi + 1) <= cm.budget(s):
                hi += 1
            if hi > last or sum(cm.base_times(s, lo, hi)) > cap or cm.keep_peak_bytes(s, lo, hi) > cm.budget(s):
                return None
            bounds.append(hi)
        return tuple(bounds)

    low, high = 0.0, cm.total_compute_s + sum(cm.send_forward_s(0, i + 1) for i in range(n)) * 2 + 1.0
    best = fill(high)
    if best is None:
        return None
    for _ in range(60):
        mid = (low + high) / 2
        found = fill(mid)
        if found is None:
            low = mid
        else:
            best, high = found, mid
    return best
