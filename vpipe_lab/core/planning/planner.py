"""Planners: uniform, balanced, gpipe, pipedream(-flush), vpipe (the paper's online search), optimal (exact, bounded)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from vpipe_lab.core import checks, schedules
from vpipe_lab.core.cost import scaling
from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.errors import InfeasiblePlan, PlanError
from vpipe_lab.core.plan import AUTO, Estimate, Plan, Policy
from vpipe_lab.core.planning import keep_all
from vpipe_lab.core.planning.chunk_plans import fit_chunks
from vpipe_lab.core.planning.layer_moves import LayerMove, layer_moves
from vpipe_lab.core.planning.memory_plans import StageProblem
from vpipe_lab.core.planning.memory_search import exact
from vpipe_lab.core.planning.methods import get
from vpipe_lab.core.planning.partition import Objective, balanced, check_fits, pareto_dp, uniform
from vpipe_lab.core.planning.vpipe_search import vpipe_search
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.core.sharding import Sharding

K = TypeVar("K")  # what a search among several is keyed by: a schedule's label, a micro-batch count
Mesh = tuple[int, int, tuple[Sharding, ...]]  # shards per stage, replicas, each stage's sharding (empty: hold)
WHOLE: Mesh = (1, 1, ())  # a pipeline of whole devices


@dataclass(frozen=True)
class PlanResult:
    """A plan with its estimate and how it was found.

    ``lower_bound_s`` is an iteration time no plan beats under the cost model; for ``optimal`` with ``proven`` it
    equals the plan's own time. ``moves`` are the layer moves from ``current`` when one was given. With a global
    ``batch_size``, ``candidates`` holds each micro-batch count tried and its estimated iteration time (None: nothing
    fit), and ``microbatch_size`` the size the chosen plan runs (``batch_size // plan.microbatches``).
    """

    plan: Plan
    estimate: Estimate
    method: str
    lower_bound_s: float
    proven_optimal: bool
    moves: tuple[LayerMove, ...]
    evaluations: int
    candidates: tuple[tuple[int, float | None], ...] = ()
    microbatch_size: int | None = None
    schedules: tuple[tuple[str, float | None], ...] = ()  # schedule="auto": each one tried and its time (None: unfit)

    @property
    def gap(self) -> float:
        """How far the plan may be from the best possible, as a fraction of the bound."""
        return self.estimate.iteration_s / self.lower_bound_s - 1.0 if self.lower_bound_s > 0 else 0.0


def _suggestions(cm: CostModel, stage: int) -> tuple[str, ...]:
    return (
        "swap or recompute more layers (method='vpipe' or 'optimal')",
        f"more stages (stages={cm.stages + 1}) to spread the layers",
        f"smaller micro-batches (more than {cm.microbatches} per mini-batch, so each holds fewer activations)",
        f"a larger memory budget for stage {stage}",
    )


def _raise_infeasible(cm: CostModel, bounds: tuple[int, ...], policies: tuple[Policy, ...], method: str,
                      missing: dict[int, int] | None = None) -> None:
    if missing is None:
        est = cm.estimate(cm.plan(bounds, policies))
        missing = {s: o for s, o in enumerate(est.over_budget) if o > 0} or {  # else as the planners count it
            s: over for s in range(cm.stages)
            if (over := cm.planned_peak_bytes(s, bounds[s], bounds[s + 1], policies) - cm.budget(s)) > 0}
    stage = max(missing, key=lambda s: missing[s])
    detail = ", ".join(f"stage {s} lacks {b:,} bytes" for s, b in sorted(missing.items()))
    raise InfeasiblePlan(
        f"method {method!r} found no plan that fits: {detail} (layers {bounds[stage]}:{bounds[stage + 1]}, "
        f"budget {cm.budget(stage):,} bytes).",
        stage=stage,
        missing_bytes=missing[stage],
        suggestions=_suggestions(cm, stage) if get(method).swaps else (
            "method='vpipe' to swap or recompute activations, which PipeDream does not do",
            *_suggestions(cm, stage)[1:],
        ),
    )


def _pipedream(cm: CostModel, method: str) -> tuple[tuple[int, ...], int]:
    """PipeDream's partition (``core/planning/keep_all.py``), or the refusal measured on the compute-balanced split."""
    bounds, transitions = keep_all.partition(cm)
    if bounds is None:  # report against the best partition that ignores memory, which PipeDream would try to run
        _raise_infeasible(cm, balanced([f + b for f, b in zip(cm.fwd, cm.bwd)], cm.stages), (Policy.KEEP,) * cm.num_layers,
                          method)
    assert bounds is not None
    return bounds, transitions


class _ExactStages:
    """Stage oracle of the exact planner: branch-and-bound memory plans, cached across stages that look alike."""

    def __init__(self, cm: CostModel, node_limit: int) -> None:
        self.cm = cm
        self.node_limit = node_limit
        self.cache: dict[tuple[int, ...], tuple[float, float, tuple[Policy, ...]] | None] = {}
        self.proven = True
        self.cap = math.inf

    def solve(self, s: int, lo: int, hi: int) -> tuple[float, float, tuple[Policy, ...]] | None:
        cm = self.cm
        key = (cm.inflight(s), cm.budget(s), s == 0, s == cm.stages - 1, lo, hi)
        if key in self.cache:
            return self.cache[key]
        fwd, bwd = cm.base_times(s, lo, hi)
        if cm.keep_peak_bytes(s, lo, hi) <= cm.budget(s):  # by the estimate's own peak
            kept = (fwd, bwd, (Policy.KEEP,) * (hi - lo))
            self.cache[key] = kept
            return kept
        problem = StageProblem.of(cm, s, lo, hi)
        solution = exact(problem, cutoff=self.cap - fwd - bwd, node_limit=self.node_limit)
        if solution is not None and not solution.proven:
            self.proven = False
        result = None if solution is None else (fwd, bwd + solution.extra_s, solution.policies)
        self.cache[key] = result
        return result

    def __call__(self, s: int, lo: int, hi: int) -> tuple[float, float] | None:
        found = self.solve(s, lo, hi)
        return None if found is None else (found[0], found[1])


def search(
    profile: ModelProfile,
    cluster: Cluster,
    *,
    microbatches: int | None = None,
    batch_size: int | None = None,
    schedule: str = "1f1b",
    method: str = "vpipe",
    current: Plan | None = None,
    node_limit: int = 200_000,
    counts: Sequence[int] | None = None,
    virtual_stages: int = 1,
    mesh: Mesh = WHOLE,
) -> PlanResult:
    """Plan ``profile`` on ``cluster`` with ``method`` and report the estimate, a lower bound and the layer moves.

    Give ``microbatches`` to plan for that many micro-batches of the profile's size. Give the global ``batch_size``
    instead to choose the micro-batch count too: every count that divides it (or those in ``counts``) is planned on
    the profile rescaled to its micro-batch size (``core/cost/scaling.py``), each within the method's own rules (GPipe
    recomputes everything, PipeDream keeps everything), and the fastest feasible plan wins.

    ``schedule="auto"`` plans every synchronous schedule (each with its own in-flight memory, so a tight budget may
    leave some out; interleaved 1F1B with 2 to 4 virtual stages where the layers and micro-batches allow, ZBV where
    the layers allow) and keeps the fastest feasible plan; ``schedules`` on the result lists what each got.
    ``method="pipedream"`` is the paper's baseline and plans its own schedule, ``"pipedream"`` (weight stashing: its
    copies of weights count against the budget); ``"pipedream-flush"`` is the same planner on the schedule given.

    ``interleaved-1f1b`` with ``virtual_stages`` V (and ``zbv``, V = 2) cuts the layers into ``stages x V`` chunks
    balanced by compute (``uniform``: by count); ``vpipe`` and ``optimal`` then keep, swap or recompute each layer
    so every rank's chunks fit its budget (``core/planning/chunk_plans.py``, greedy: not proven optimal); vPipe's partition
    refinement works on one chunk per stage and is not applied to chunks.

    ``mesh`` (shards, replicas, each stage's sharding) is what each stage runs on: its ranks' memory and the
    collectives are priced by the cost model (``core/cost/sharded.py``); ``core/planning/mesh.py`` chooses the
    sharding and the mesh itself around this search.
    """
    if (own := get(method).schedule) is not None:  # PipeDream: its own schedule, weight stashing
        schedule, virtual_stages = own, 1
    if schedule == AUTO:
        return _search_schedules(profile, cluster, microbatches=microbatches, batch_size=batch_size, method=method,
                                 current=current, node_limit=node_limit, counts=counts, mesh=mesh)
    kind = schedules.get(schedule)
    if kind.chunked or virtual_stages != 1:
        problem = schedules.virtual_refusal(schedule, virtual_stages) if virtual_stages != 1 or not kind.chunked else None
        if problem:
            raise PlanError(f"virtual_stages={virtual_stages} does not go with schedule={schedule!r}: {problem}")
        if batch_size is not None or microbatches is None:
            raise PlanError(f"{schedule} plans a fixed micro-batch count: give microbatches (how many per iteration, "
                            "a multiple of the stages), not batch_size")
        virtual = kind.virtual_choices[0] if kind.virtual_choices and virtual_stages == 1 else virtual_stages
        return _chunked(profile, cluster, microbatches, schedule, virtual, method, current, mesh)
    if batch_size is not None:
        if microbatches is not None:
            raise PlanError("give either microbatches (a fixed count) or batch_size (the planner chooses the count), "
                            "not both")
        return _search_counts(profile, cluster, batch_size, counts, schedule=schedule, method=method,
                              current=current, node_limit=node_limit, mesh=mesh)
    if microbatches is None:
        raise PlanError("give microbatches (how many per iteration) or batch_size (the global batch, to choose them)")
    return _search(profile, cluster, microbatches=microbatches, schedule=schedule, method=method, current=current,
                   node_limit=node_limit, mesh=mesh)


def _check_method(method: str) -> None:
    get(method)  # PlanError naming the methods


def _chunked(profile: ModelProfile, cluster: Cluster, m: int, schedule: str, virtual: int, method: str,
             current: Plan | None, mesh: Mesh = WHOLE) -> PlanResult:
    """Interleaved 1F1B or ZBV: the layers cut into chunks balanced by compute, then each layer's policy."""
    _check_method(method)
    cm = CostModel(profile, cluster, m, schedule, virtual, mesh[0], mesh[2], mesh[1])
    check_fits(cm.num_layers, cm.chunks)
    compute = [f + b for f, b in zip(cm.fwd, cm.bwd)]
    how = get(method)
    bounds = uniform(cm.num_layers, cm.chunks) if how.partition == "uniform" else balanced(compute, cm.chunks)
    # A method that fixes the policy (GPipe recomputes everything, the all-keep ones keep everything) applies it;
    # vPipe and optimal keep, swap and recompute per layer across a rank's chunks (core/planning/chunk_plans.py).
    policies = (how.policy,) * cm.num_layers if how.policy is not None else fit_chunks(cm, bounds)
    found = cm.plan(bounds, policies)
    est = cm.estimate(found)
    if est.feasible:
        moves = layer_moves(current.boundaries, bounds, cm.stages, (current.placement, found.placement)
                            ) if current is not None else ()
        return PlanResult(found, est, method, cm.lower_bound_s(), False, moves, 1)
    stage = max(range(cm.stages), key=lambda s: est.over_budget[s])
    raise InfeasiblePlan(f"{schedule} with {virtual} virtual stages per stage does not fit: stage {stage} needs "
                         f"{est.peak_bytes[stage]} bytes of {est.budget_bytes[stage]}", stage=stage,
                         missing_bytes=est.over_budget[stage], suggestions=_suggestions(cm, stage))


def _candidates(profile: ModelProfile, cluster: Cluster, microbatches: int | None) -> list[tuple[str, int]]:
    """Every (schedule, virtual stages) that ``auto`` tries."""
    # each schedule says which of its shapes "auto" may try (never one with other training semantics)
    return [(kind.name, v) for kind in schedules.kinds()
            for v in kind.auto_virtuals(cluster.stages, len(profile.layers), microbatches)]


def _fastest(attempts: Iterable[tuple[K, Callable[[], PlanResult]]]
             ) -> tuple[PlanResult | None, list[tuple[K, float | None]], InfeasiblePlan | None]:
    """Run each search; the fastest feasible result, each key with its time (None: nothing fit), and the refusal
    that came closest to fitting."""
    tried: list[tuple[K, float | None]] = []
    best: PlanResult | None = None
    closest: InfeasiblePlan | None = None
    for key, attempt in attempts:
        try:
            found = attempt()
        except InfeasiblePlan as exc:
            tried.append((key, None))
            closest = exc if closest is None or exc.missing_bytes < closest.missing_bytes else closest
            continue
        tried.append((key, found.estimate.iteration_s))
        if best is None or found.estimate.iteration_s < best.estimate.iteration_s:
            best = found
    return best, tried, closest


def _search_schedules(profile: ModelProfile, cluster: Cluster, **options: Any) -> PlanResult:
    def attempt(schedule: str, virtual: int) -> Callable[[], PlanResult]:
        extra = {"virtual_stages": virtual, "batch_size": None} if virtual > 1 else {}
        return functools.partial(search, profile, cluster, schedule=schedule, **{**options, **extra})

    best, tried, closest = _fastest((schedule if virtual == 1 or schedules.get(schedule).virtual_choices
                                     else f"{schedule} V={virtual}",
                                     attempt(schedule, virtual))
                                    for schedule, virtual in _candidates(profile, cluster, options.get("microbatches")))
    if best is None:
        assert closest is not None
        raise InfeasiblePlan(f"no schedule fits: {closest}", stage=closest.stage, missing_bytes=closest.missing_bytes,
                             suggestions=closest.suggestions)
    return replace(best, schedules=tuple(tried))


def _search_counts(profile: ModelProfile, cluster: Cluster, batch_size: int, counts: Sequence[int] | None,
                   **options: Any) -> PlanResult:
    checks.count(batch_size, "batch_size", error=PlanError)
    wanted = sorted(set(counts)) if counts is not None else [m for m in range(1, batch_size + 1)
                                                              if batch_size % m == 0]
    bad = [m for m in wanted if isinstance(m, bool) or not isinstance(m, int) or m < 1 or batch_size % m]
    if bad or not wanted:
        raise PlanError(f"micro-batch counts {bad or wanted} do not divide the batch of {batch_size}: give counts "
                        "that divide it")
    best, tried, closest = _fastest(
        (m, functools.partial(_search, scaling.at(profile, batch_size // m), cluster, microbatches=m, **options))
        for m in wanted)
    if best is None:
        assert closest is not None
        raise InfeasiblePlan(f"{options['method']} fits no plan for a batch of {batch_size} with any micro-batch count "
                             f"in {wanted}; the closest: {closest}", stage=closest.stage,
                             missing_bytes=closest.missing_bytes, suggestions=closest.suggestions)
    return replace(best, candidates=tuple(tried), microbatch_size=batch_size // best.plan.microbatches)


def _search(
    profile: ModelProfile,
    cluster: Cluster,
    *,
    microbatches: int,
    schedule: str,
    method: str,
    current: Plan | None,
    node_limit: int,
    mesh: Mesh = WHOLE,
) -> PlanResult:
    _check_method(method)
    cm = CostModel(profile, cluster, microbatches, schedule, 1, mesh[0], mesh[2], mesh[1])
    n, k = cm.num_layers, cm.stages
    check_fits(n, k)
    if current is not None:
        current.validate(n, k)
    keep = (Policy.KEEP,) * n
    evaluations = 0
    proven = False
    lower = cm.lower_bound_s()
    how = get(method)
    if how.partition in ("uniform", "balanced"):
        bounds = uniform(n, k) if how.partition == "uniform" else balanced([f + b for f, b in zip(cm.fwd, cm.bwd)], k)
        policies = (how.policy or Policy.KEEP,) * n
        if how.refuses_overflow and not cm.estimate(cm.plan(bounds, policies)).feasible:
            _raise_infeasible(cm, bounds, policies, method)
    elif how.partition == "bottleneck":
        bounds, evaluations = _pipedream(cm, method)
        policies = keep
    else:
        start = current.boundaries if current is not None else balanced([f + b for f, b in zip(cm.fwd, cm.bwd)], k)
        bounds, policies, oracle = vpipe_search(cm, start)
        evaluations = oracle.evaluations
        stuck = {s: ev.deficit for s in range(k) if (ev := oracle(s, bounds[s], bounds[s + 1])).deficit > 0}
        if how.exact:
            found, policies, proven, lower, evals = _optimal(cm, bounds, policies, feasible=not stuck,
                                                             node_limit=node_limit)
            evaluations += evals
            if found is None:
                _raise_infeasible(cm, tuple(start), keep, method, stuck or {0: 1})
            assert found is not None
            bounds = found
        elif stuck:
            _raise_infeasible(cm, bounds, policies, method, stuck)
    assert bounds is not None
    plan = cm.plan(bounds, policies)
    est = cm.estimate(plan)
    moves = layer_moves(current.boundaries, bounds) if current is not None else ()
    return PlanResult(plan, est, method, lower if not proven else est.iteration_s, proven, moves, evaluations)


def _optimal(cm: CostModel, bounds: tuple[int, ...], policies: tuple[Policy, ...], *, feasible: bool, node_limit: int
             ) -> tuple[tuple[int, ...] | None, tuple[Policy, ...], bool, float, int]:
    """Exact search seeded with vPipe's plan as the bound to beat; returns (bounds, policies, proven, bound, work)."""
    upper = cm.estimate(cm.plan(bounds, policies)).iteration_s if feasible else math.inf
    objective = Objective(cm.kind.flush, cm.microbatches)
    stages = _ExactStages(cm, node_limit)
    stages.cap = objective.stage_cap(upper, cm.total_compute_s)
    # Accept only strict improvements beyond rounding, so the seed stands when nothing is really better.
    result = pareto_dp(cm.num_layers, cm.stages, stages, cm.compute_prefix, objective, upper * (1 - 1e-12))
    lower = cm.lower_bound_s()
    if result.boundaries is None:
        if not feasible:
            return None, policies, False, lower, result.transitions
        return bounds, policies, stages.proven, lower, result.transitions
    new_policies: list[Policy] = []
    for s in range(cm.stages):
        found = stages.solve(s, result.boundaries[s], result.boundaries[s + 1])
        assert found is not None
        new_policies.extend(found[2])
    return result.boundaries, tuple(new_policies), stages.proven, lower, result.transitions


def plan(
    profile: ModelProfile,
    cluster: Cluster,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    method: str = "vpipe",
    current: Plan | None = None,
) -> Plan:
    """The plan ``method`` finds for ``profile`` on ``cluster`` (see ``search`` for the estimate and the bound)."""
    return search(profile, cluster, microbatches=microbatches, schedule=schedule, method=method,
                  current=current).plan
