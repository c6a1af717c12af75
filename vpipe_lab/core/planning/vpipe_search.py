"""vPipe's online partition search: move boundary layers of the bottleneck stage to adjacent stages while it helps.

Every candidate is a move live migration can carry out (layers cross between neighbouring stages). Besides the
paper's single-layer moves this also tries ripple moves, where the receiving neighbour passes a layer on in the same
direction, which lets a heavy stage shed load through a chain of stages in one step.

Each stage's memory plan is vPipe's rule (``memory_plans.greedy``); where the rule finds nothing that fits, and on the
stages of the partition found, the branch-and-bound on the estimate's own peak (``memory_search.exact``, at most
``SETTLE_NODES`` nodes) settles it: the rule picks one layer at a time by a count and misses pairs of changes (swap
one layer, keep another) and stages the count calls full that fit by the estimate the user is shown. On 155 small
random chains under binding budgets this took vPipe from 5 missed plans and 0.8% over exhaustive search (geometric
mean) to none missed and 0.08% (tests/core/planning/test_planner.py; benchmarks/RESULTS.md).

A partition that does not fit scores by the bytes its stages lack (``shortfall``: the leanest uniform plan's peak
over the budget, which falls as a stage sheds layers); where the climb still ends on one that does not fit (the
shortfall can plateau), it climbs again from a partition every stage of which fits (``fitting_cover``), so vPipe
finds a plan wherever one fits by the estimate (held by hypothesis against exhaustive search).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.plan import Policy
from vpipe_lab.core.planning.memory_plans import StageProblem, StageSolution, greedy
from vpipe_lab.core.planning.memory_search import exact
from vpipe_lab.core.planning.partition import Objective

SETTLE_NODES = 1_000  # the branch-and-bound's nodes per stage when the found partition's memory plans are settled
COVER_EVALUATIONS = 100  # stages the fallback cover may evaluate before it gives up (~0.3 s, stages of 64 layers)


@dataclass(frozen=True)
class StageEval:
    """A stage under vPipe's greedy memory plan; ``deficit`` > 0 means it cannot fit at all."""

    forward_s: float
    backward_s: float
    solution: StageSolution | None
    deficit: int


class StageOracle:
    """Caches stage evaluations by (stage, lo, hi) under the greedy memory plan."""

    def __init__(self, cm: CostModel) -> None:
        self.cm = cm
        self.cache: dict[tuple[int, int, int], StageEval] = {}
        self.evaluations = 0

    def __call__(self, stage: int, lo: int, hi: int) -> StageEval:
        key = (stage, lo, hi)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        self.evaluations += 1
        cm = self.cm
        fwd, bwd = cm.base_times(stage, lo, hi)
        problem = StageProblem.of(cm, stage, lo, hi)
        # vPipe's rule; where it finds nothing that fits, the branch-and-bound on the estimate's peak may (a stage
        # the rule's count calls full can fit by the estimate), so the partition search is not steered away from it
        solution = greedy(problem) or exact(problem, node_limit=SETTLE_NODES)
        if solution is None:
            result = StageEval(fwd, math.inf, None, shortfall(cm, stage, lo, hi))
        else:
            result = StageEval(fwd, bwd + solution.extra_s, solution, 0)
        self.cache[key] = result
        return result


    def settle(self, stage: int, lo: int, hi: int, node_limit: int = SETTLE_NODES) -> StageEval:
        """The stage of the partition found, its memory plan settled by the branch-and-bound on the estimate's own
        peak (``exact``, at most ``node_limit`` nodes) where vPipe's rule swapped or recomputed anything: the rule
        picks by bytes per second of a count, and a pair of changes (swap one layer, keep another) it never weighs
        can be cheaper. Kept as this oracle's answer for the range, so callers see the plan returned."""
        ev = self(stage, lo, hi)
        if ev.solution is not None and ev.solution.extra_s <= 0:
            return ev  # nothing costs less than nothing: every layer kept, or every swap hidden
        problem = StageProblem.of(self.cm, stage, lo, hi)
        cutoff = ev.solution.extra_s if ev.solution is not None else math.inf
        found = exact(problem, cutoff=cutoff, node_limit=node_limit)
        if found is None or (ev.solution is not None and found.extra_s >= ev.solution.extra_s):
            return ev
        fwd, bwd = self.cm.base_times(stage, lo, hi)
        settled = StageEval(fwd, bwd + found.extra_s, found, 0)
        self.cache[(stage, lo, hi)] = settled
        return settled


def shortfall(cm: CostModel, stage: int, lo: int, hi: int) -> int:
    """Bytes a stage no plan fits lacks: the estimate's peak of its leanest uniform plan (every layer kept, swapped or
    recomputed) over its budget, at least 1. It falls as the stage sheds layers, so the search sees a move towards a
    fit as progress (a placeholder of 1 did not, and missed plans that fit), and it is what the refusal reports."""
    policies = [Policy.KEEP] * cm.num_layers
    lean = math.inf
    for choice in Policy:
        policies[lo:hi] = [choice] * (hi - lo)
        lean = min(lean, cm.peak_bytes(stage, lo, hi, policies))
    return max(1, int(lean) - cm.budget(stage))


def score(cm: CostModel, oracle: StageOracle, bounds: Sequence[int]) -> tuple[int, float, float]:
    """(bytes missing over all stages, iteration time, largest stage time): lower is better, lexicographically."""
    objective = Objective(cm.kind.flush, cm.microbatches)
    key = objective.start()
    evals = [oracle(s, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]
    for ev in evals:
        key = objective.extend(key, ev.forward_s, ev.backward_s)
    deficit = sum(ev.deficit for ev in evals)
    return deficit, objective.value(key), max(ev.forward_s + ev.backward_s for ev in evals)


def _stage_s(oracle: StageOracle, s: int, lo: int, hi: int) -> float:
    ev = oracle(s, lo, hi)
    return ev.forward_s + ev.backward_s


def _push(oracle: StageOracle, bounds: tuple[int, ...], stage: int, step: int, target: float) -> tuple[int, ...] | None:
    """The bottleneck sheds one layer towards ``step`` (-1 left, +1 right); each neighbour in turn passes on as many
    layers as it must to stay under ``target``. A chain of adjacent-stage moves, as live migration performs them."""
    k = len(bounds) - 1
    b = list(bounds)
    if step < 0:
        if stage == 0 or b[stage] + 1 >= b[stage + 1]:
            return None
        b[stage] += 1
        for j in range(stage - 1, -1, -1):
            while _stage_s(oracle, j, b[j], b[j + 1]) >= target and j > 0 and b[j] + 1 < b[j + 1]:
                b[j] += 1
            if j == 0 or _stage_s(oracle, j, b[j], b[j + 1]) < target:
                break
    else:
        if stage == k - 1 or b[stage + 1] - 1 <= b[stage]:
            return None
        b[stage + 1] -= 1
        for j in range(stage + 1, k):
            while _stage_s(oracle, j, b[j], b[j + 1]) >= target and j < k - 1 and b[j + 1] - 1 > b[j]:
                b[j + 1] -= 1
            if j == k - 1 or _stage_s(oracle, j, b[j], b[j + 1]) < target:
                break
    return tuple(b)


def _candidates(oracle: StageOracle, bounds: tuple[int, ...], stage: int) -> list[tuple[int, ...]]:
    """Partitions one move away from ``bounds``: the paper's single-layer moves off ``stage``, ripples that shift
    every boundary on one side by a layer, and push chains."""
    k = len(bounds) - 1
    out: list[tuple[int, ...]] = []
    b = list(bounds)
    for j in range(stage, 0, -1):
        b[j] += 1
        if b[j] >= b[j + 1] or b[j - 1] >= b[j]:
            break
        out.append(tuple(b))
    b = list(bounds)
    for j in range(stage + 1, k):
        b[j] -= 1
        if b[j] <= b[j - 1]:
            break
        out.append(tuple(b))
    target = _stage_s(oracle, stage, bounds[stage], bounds[stage + 1])
    for step in (-1, 1):
        pushed = _push(oracle, bounds, stage, step, target)
        if pushed is not None:
            out.append(pushed)
    return out


def fitting_cover(cm: CostModel, oracle: StageOracle) -> tuple[int, ...] | None:
    """A partition whose every stage fits by the oracle, or None where none does: stage by stage, every boundary a
    fitting stage can end at, from every boundary the stages before it reached. A stage whose optimizer step alone is
    over the budget (no policy lowers it; more layers only add to it) ends its scan, as do ``COVER_EVALUATIONS`` new
    stage evaluations. Where the climb ends on a partition that does not fit, this finds one that does if any does
    (the shortfall can plateau: a stage held over by a boundary's tensors lacks the same bytes as it sheds layers)."""
    n, k = cm.num_layers, cm.stages
    limit = oracle.evaluations + COVER_EVALUATIONS
    reached: list[dict[int, int]] = [{0: 0}]  # per stage: the boundary it ends at -> where it began
    for s in range(k):
        ends: dict[int, int] = {}
        for lo in sorted(reached[-1]):
            for hi in ([n] if s == k - 1 else range(lo + 1, n - (k - s - 1) + 1)):
                if cm.step_peak_bytes(s, lo, hi) > cm.budget(s) or oracle.evaluations > limit:
                    break
                if hi not in ends and oracle(s, lo, hi).deficit == 0:
                    ends[hi] = lo
        if not ends:
            return None
        reached.append(ends)
    bounds = [n]
    for s in range(k, 0, -1):
        bounds.append(reached[s][bounds[-1]])
    return tuple(reversed(bounds))


def vpipe_search(cm: CostModel, start: Sequence[int], oracle: StageOracle | None = None,
                 max_rounds: int = 100_000) -> tuple[tuple[int, ...], tuple[Policy, ...], StageOracle]:
    """Hill-climb from ``start``: each round applies the best move off the worst stage; stops when none helps. Where
    it ends on a partition that does not fit, it climbs again from one that fits (``fitting_cover``), if any does."""
    oracle = oracle or StageOracle(cm)
    bounds = _climb(cm, oracle, tuple(start), max_rounds)
    if score(cm, oracle, bounds)[0] > 0:
        cover = fitting_cover(cm, oracle)
        if cover is not None:
            bounds = _climb(cm, oracle, cover, max_rounds)
    policies: list[Policy] = [Policy.KEEP] * cm.num_layers
    for s in range(len(bounds) - 1):
        ev = oracle.settle(s, bounds[s], bounds[s + 1])
        if ev.solution is not None:
            policies[bounds[s]:bounds[s + 1]] = ev.solution.policies
    return bounds, tuple(policies), oracle


def _climb(cm: CostModel, oracle: StageOracle, bounds: tuple[int, ...], max_rounds: int) -> tuple[int, ...]:
    """Rounds of the best move off the worst stage (else the second worst) while one scores better; where it ends."""
    k = len(bounds) - 1
    best = score(cm, oracle, bounds)
    for _ in range(max_rounds):
        evals = [oracle(s, bounds[s], bounds[s + 1]) for s in range(k)]
        # The worst stage first: the one missing most memory, else the slowest.
        order = sorted(range(k), key=lambda s: (-evals[s].deficit, -(evals[s].forward_s + evals[s].backward_s)))
        improved = False
        for stage in order[:2]:
            found = min(((score(cm, oracle, c), c) for c in _candidates(oracle, bounds, stage)), default=None)
            if found is not None and found[0] < best:
                best, bounds = found
                improved = True
                break
        if not improved:
            break
    return bounds
