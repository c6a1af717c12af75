"""Contiguous partitions of a layer chain into stages: uniform, time-balanced, and an exact banded Pareto DP."""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.schedules.kind import BOTTLENECK, GPIPE_SHAPED

# (forward_s, backward_s) of a stage, or None when the stage cannot hold those layers.
StageFn = Callable[[int, int, int], "tuple[float, float] | None"]


def check_fits(num_layers: int, stages: int) -> None:
    if stages < 1 or num_layers < stages:
        raise PlanError(
            f"cannot split {num_layers} layers into {stages} stages: every stage needs at least one layer; "
            f"use at most {num_layers} stages or a finer-grained profile"
        )


def uniform(num_layers: int, stages: int) -> tuple[int, ...]:
    """Equal layer counts (GPipe's default); the first ``num_layers % stages`` stages take one layer more."""
    check_fits(num_layers, stages)
    q, r = divmod(num_layers, stages)
    return tuple(accumulate([0] + [q + (1 if s < r else 0) for s in range(stages)]))


def _greedy_cover(prefix: Sequence[float], stages: int, cap: float) -> tuple[int, ...] | None:
    """Fill each stage as far as ``cap`` allows (leaving a layer for each later stage); None if that fails."""
    n = len(prefix) - 1
    bounds = [0]
    for s in range(stages):
        lo = bounds[-1]
        hi = bisect_right(prefix, prefix[lo] + cap, lo) - 1
        hi = min(hi, n - (stages - s - 1))
        if s == stages - 1:
            hi = n if prefix[n] - prefix[lo] <= cap else lo
        if hi <= lo:
            return None
        bounds.append(hi)
    return tuple(bounds)


def balanced(times: Sequence[float], stages: int) -> tuple[int, ...]:
    """The partition minimising the largest stage sum of ``times`` (torchgpipe's balance by time).

    Parametric search: each feasible cap is tightened to the partition's actual maximum, so the answer is exact up to
    floating-point ties.
    """
    check_fits(len(times), stages)
    prefix = [0.0, *accumulate(times)]
    total = prefix[-1]
    lo = max(max(times), total / stages)
    best = _greedy_cover(prefix, stages, total)
    assert best is not None
    hi = max(prefix[b] - prefix[a] for a, b in pairwise(best))
    for _ in range(200):
        if hi - lo <= 1e-12 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        found = _greedy_cover(prefix, stages, mid)
        if found is None:
            lo = mid
        else:
            best = found
            hi = max(prefix[b] - prefix[a] for a, b in pairwise(found))
    found = _greedy_cover(prefix, stages, lo)
    if found is not None:
        best = found
    return best


@dataclass(frozen=True)
class Objective:
    """How stage times combine: ``BOTTLENECK`` (max stage), or a schedule's iteration time by its ``flush`` shape
    (``GPIPE_SHAPED`` or ``ONE_F_ONE_B_SHAPED``, ``core/schedules/kind.py``)."""

    kind: str
    microbatches: int = 1

    def start(self) -> tuple[float, ...]:
        return (0.0,) if self.kind == BOTTLENECK else (0.0, 0.0, 0.0) if self.kind == GPIPE_SHAPED else (0.0, 0.0)

    def extend(self, key: tuple[float, ...], fwd: float, bwd: float) -> tuple[float, ...]:
        t = fwd + bwd
        if self.kind == BOTTLENECK:
            return (max(key[0], t),)
        if self.kind == GPIPE_SHAPED:
            return (max(key[0], fwd), max(key[1], bwd), key[2] + t)
        return (max(key[0], t), key[1] + t)

    def value(self, key: tuple[float, ...]) -> float:
        if self.kind == BOTTLENECK:
            return key[0]
        if self.kind == GPIPE_SHAPED:
            return (self.microbatches - 1) * (key[0] + key[1]) + key[2]
        return (self.microbatches - 1) * key[0] + key[1]

    def stage_cap(self, upper: float, total_compute: float) -> float:
        """The largest stage time a plan better than ``upper`` can have."""
        if math.isinf(upper):
            return math.inf
        if self.kind == BOTTLENECK:
            return upper
        if self.microbatches == 1:
            return upper
        return (upper - total_compute) / (self.microbatches - 1) * (1 + 1e-12)


class _Front:
    """Pareto front of one DP state under componentwise <= on dominance keys; 1-D and 2-D fronts are staircases."""

    __slots__ = ("dkeys", "keys", "links")

    def __init__(self) -> None:
        self.dkeys: list[tuple[float, ...]] = []
        self.keys: list[tuple[float, ...]] = []
        self.links: list[tuple[int, int]] = []

    def insert(self, dkey: tuple[float, ...], key: tuple[float, ...], link: tuple[int, int]) -> None:
        d = self.dkeys
        if len(dkey) <= 2:
            # Sorted by the first coordinate, the second strictly decreasing.
            a = dkey[0]
            b = dkey[1] if len(dkey) == 2 else 0.0
            i = bisect_right(d, (a, math.inf))
            if i > 0 and (d[i - 1][1] if len(dkey) == 2 else 0.0) <= b:
                return
            lo = bisect_left(d, (a, -math.inf))
            j = lo
            while j < len(d) and (d[j][1] if len(dkey) == 2 else 0.0) >= b:
                j += 1
            d[lo:j] = [dkey]
            self.keys[lo:j] = [key]
            self.links[lo:j] = [link]
            return
        if any(all(x <= y for x, y in zip(other, dkey)) for other in d):
            return
        keep = [i for i, other in enumerate(d) if not all(x <= y for x, y in zip(dkey, other))]
        self.dkeys = [d[i] for i in keep] + [dkey]
        self.keys = [self.keys[i] for i in keep] + [key]
        self.links = [self.links[i] for i in keep] + [link]


@dataclass
class DPResult:
    boundaries: tuple[int, ...] | None
    value: float
    transitions: int


def pareto_dp(
    num_layers: int,
    stages: int,
    stage_fn: StageFn,
    compute_prefix: Sequence[float],
    objective: Objective,
    upper: float = math.inf,
    layer_compute: Sequence[float] | None = None,
) -> DPResult:
    """Exact search over all contiguous partitions for the one minimising ``objective``, strictly below ``upper``.

    ``compute_prefix`` gives a lower bound on every stage's time that is monotone in its range; with ``upper`` from a
    good heuristic it confines each boundary to a narrow band, which keeps the search small. Each state (stage, end)
    keeps the Pareto front of partial keys (bottleneck(s), sum), so the combined objective is optimised exactly.
    Future stages are at least as slow as ``floor`` (the larger of their average compute and their largest layer),
    so bottlenecks below it are equivalent and collapse, which keeps the fronts short.
    """
    check_fits(num_layers, stages)
    total = compute_prefix[-1]
    cap = objective.stage_cap(upper, total)
    n, k = num_layers, stages
    per_layer = list(layer_compute) if layer_compute is not None else [
        compute_prefix[i + 1] - compute_prefix[i] for i in range(n)]
    suffix_max = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_max[i] = max(suffix_max[i + 1], per_layer[i])
    fwd_reach, back_reach = _band(n, k, compute_prefix, cap)
    fronts: list[dict[int, _Front]] = [dict() for _ in range(k)]
    origin = _Front()
    origin.insert(objective.start(), objective.start(), (-1, -1))
    prev: dict[int, _Front] = {0: origin}
    transitions = 0
    m1 = objective.microbatches - 1
    for s in range(k):
        lo_r = max(s + 1, back_reach[s] if s < k - 1 else n)
        hi_r = n if s == k - 1 else min(fwd_reach[s], n - (k - s - 1))
        cur = fronts[s]
        starts = sorted(prev, reverse=True)
        left = k - s - 1
        for r in range(lo_r, hi_r + 1):
            rest = total - compute_prefix[r]
            floor = max(rest / left, suffix_max[r]) if left else 0.0
            front = _Front()
            for l_pos in starts:
                if l_pos >= r:
                    continue
                if compute_prefix[r] - compute_prefix[l_pos] > cap:
                    break  # stages further left only grow
                times = stage_fn(s, l_pos, r)
                transitions += 1
                if times is None or times[0] + times[1] > cap:
                    continue
                _extend(front, prev[l_pos], l_pos, times, objective, floor, rest, upper, m1)
            if front.keys:
                cur[r] = front
        prev = cur
        if not prev:
            return DPResult(None, math.inf, transitions)
    return _best(fronts, n, k, objective, transitions)


def _band(n: int, k: int, compute_prefix: Sequence[float], cap: float) -> tuple[list[int], list[int]]:
    """Stage s may end at r only if [0, r) fits in s+1 stages and [r, n) in the remaining ones under ``cap``: the
    furthest each stage can reach from the left, and the nearest it must reach from the right."""
    fwd_reach, back_reach = [0] * k, [n] * k
    pos = 0
    for s in range(k):
        pos = bisect_right(compute_prefix, compute_prefix[pos] + cap, pos) - 1 if not math.isinf(cap) else n
        pos = min(max(pos, s + 1), n - (k - s - 1))
        fwd_reach[s] = pos
    pos = n
    for s in range(k - 1, 0, -1):
        r = 0 if math.isinf(cap) else bisect_left(compute_prefix, compute_prefix[pos] - cap)
        pos = max(min(r, pos - 1), s)
        back_reach[s - 1] = pos
    return fwd_reach, back_reach


def _extend(front: _Front, source: _Front, l_pos: int, times: tuple[float, float], objective: Objective,
            floor: float, rest: float, upper: float, m1: int) -> None:
    """Every partial key ending at ``l_pos`` extended by one stage of ``times`` into ``front``, unless it cannot
    beat ``upper`` even if the ``rest`` of the layers cost nothing more than their compute."""
    for idx, key in enumerate(source.keys):
        new = objective.extend(key, *times)
        if objective.kind == BOTTLENECK:
            if new[0] >= upper:
                continue
            front.insert((max(new[0], floor),), new, (l_pos, idx))
        elif objective.kind != GPIPE_SHAPED:  # 1F1B-shaped
            value = m1 * max(new[0], floor) + new[1]
            if value + rest >= upper:
                continue
            front.insert((new[1], value), new, (l_pos, idx))
        else:
            if objective.value(new) + rest >= upper:
                continue
            front.insert(new, new, (l_pos, idx))


def _best(fronts: list[dict[int, _Front]], n: int, k: int, objective: Objective, transitions: int) -> DPResult:
    """The best complete partition in the last stage's front, its boundaries traced back through the links."""
    final = fronts[k - 1].get(n)
    if final is None or not final.keys:
        return DPResult(None, math.inf, transitions)
    best_idx = min(range(len(final.keys)), key=lambda i: objective.value(final.keys[i]))
    value = objective.value(final.keys[best_idx])
    bounds = [n]
    idx = best_idx
    for s in range(k - 1, 0, -1):
        l_pos, idx = fronts[s][bounds[-1]].links[idx]
        bounds.append(l_pos)
    bounds.append(0)
    return DPResult(tuple(reversed(bounds)), value, transitions)


