import math

import pytest
from hypothesis import HealthCheck, given, settings

from tests.core.strategies import binding_budget, exhaustive, problems
from vpipe_lab.core.cost.costmodel import CostModel, estimate
from vpipe_lab.core.errors import InfeasiblePlan, PlanError
from vpipe_lab.core.plan import Plan, Policy
from vpipe_lab.core.planning.methods import METHODS
from vpipe_lab.core.planning.partition import balanced
from vpipe_lab.core.planning.planner import plan, search
from vpipe_lab.core.planning.vpipe_search import StageOracle, fitting_cover, score
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile
from vpipe_lab.core.workloads import cluster, pressured_cluster, random_chain, workload

Case = tuple[ModelProfile, Cluster, int, str]


def run(case: Case, method: str) -> Plan | None:
    profile, cl, m, schedule = case
    try:
        return plan(profile, cl, microbatches=m, schedule=schedule, method=method)
    except InfeasiblePlan:
        return None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_plan_covers_all_layers_contiguously(case: Case) -> None:
    profile, cl, _, _ = case
    for method in METHODS:
        p = run(case, method)
        if p is None:
            continue
        p.validate(len(profile), cl.stages)
        owned = [i for s in range(p.stages) for i in p.layers_of(s)]
        assert owned == list(range(len(profile)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_feasible_plans_respect_every_budget(case: Case) -> None:
    profile, cl, _, _ = case
    for method in ("gpipe", "pipedream", "vpipe", "optimal"):
        p = run(case, method)
        if p is not None:  # these methods raise rather than return a plan that does not fit
            est = estimate(p, profile, cl)
            assert est.feasible and all(pk <= b for pk, b in zip(est.peak_bytes, est.budget_bytes))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_vpipe_is_never_worse_than_its_start(case: Case) -> None:
    profile, cl, m, schedule = case
    cm = CostModel(profile, cl, m, schedule)
    start = balanced([f + b for f, b in zip(cm.fwd, cm.bwd)], cl.stages)
    start_score = score(cm, StageOracle(cm), start)
    p = run(case, "vpipe")
    if p is None:
        assert start_score[0] > 0  # vPipe only gives up where its start did not fit either
        return
    # by vPipe's own rule (the hill-climb's score; a stage no policy of the rule fits has no time: nan, as infinite)
    def key(found: tuple[int, float, float]) -> tuple[int, float, float]:
        return found[0], math.inf if math.isnan(found[1]) else found[1], found[2]

    assert key(score(cm, StageOracle(cm), p.boundaries)) <= key(start_score)
    assert estimate(p, profile, cl).feasible or start_score[0] > 0  # the settled plan fits wherever the start did


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_layers=6))
def test_optimal_matches_exhaustive_search_and_beats_every_method(case: Case) -> None:
    profile, cl, m, schedule = case
    best, _ = exhaustive(profile, cl, m, schedule)
    result = None
    try:
        result = search(profile, cl, microbatches=m, schedule=schedule, method="optimal")
    except InfeasiblePlan:
        assert math.isinf(best)
        return
    assert result.proven_optimal
    assert math.isclose(result.estimate.iteration_s, best, rel_tol=1e-9)
    assert math.isclose(result.lower_bound_s, best, rel_tol=1e-9)
    assert run(case, "vpipe") is not None  # vPipe's search finds a plan wherever one fits by the estimate
    for method in METHODS:
        p = run(case, method)
        if p is not None and p.schedule == schedule:  # (PipeDream plans its own schedule: another problem)
            est = estimate(p, profile, cl)
            # optimal among every plan that fits by the estimate the user is shown (uniform and balanced ignore memory)
            if est.feasible:
                assert result.estimate.iteration_s <= est.iteration_s * (1 + 1e-9), method


def test_methods_on_a_paper_workload() -> None:
    profile = workload("bert-48")
    cl = cluster("rtx2080ti", 8)
    results = {m: search(profile, cl, microbatches=16, method=m) for m in ("gpipe", "pipedream", "vpipe", "optimal")}
    t = {m: r.estimate.iteration_s for m, r in results.items()}
    assert t["optimal"] <= t["vpipe"] < t["pipedream"] < t["gpipe"]
    assert results["optimal"].proven_optimal
    assert not estimate(plan(profile, cl, microbatches=16, method="uniform"), profile, cl).feasible
    # vPipe relieves the early stages, where 1F1B holds the most micro-batches (the paper's observation).
    pols = results["vpipe"].plan.policies
    per_stage = [sum(p is not Policy.KEEP for p in pols[r.start:r.stop]) for r in map(results["vpipe"].plan.layers_of,
                                                                                      range(8))]
    assert per_stage[0] >= per_stage[-1]


def test_refinement_from_current_reports_moves() -> None:
    profile = random_chain(48, seed=3)
    cl = pressured_cluster(profile, 4, 8, pressure=0.9)
    current = Plan.from_counts([20, 4, 4, 20], 8)
    result = search(profile, cl, microbatches=8, method="vpipe", current=current)
    assert result.moves and all(abs(mv.src - mv.dst) >= 1 for mv in result.moves)
    assert {mv.layer for mv in result.moves} == {
        i for i in range(48) if current.stage_of(i) != result.plan.stage_of(i)}
    assert result.estimate.iteration_s < estimate(current.with_policies(result.plan.policies), profile, cl).iteration_s \
        or not estimate(current, profile, cl).feasible


def test_vpipe_sheds_layers_off_a_stage_that_fits_by_no_plan_until_it_does() -> None:
    """Found by hypothesis: 4 units on 2 stages where only (0, 1, 4) fits. From the balanced (0, 3, 4) the search saw
    (0, 2, 4) as no better while an unfitting stage's shortfall was a placeholder 1 byte; now it is the leanest plan's
    peak over the budget, which falls as the stage sheds a layer, and the refusal reports that number."""
    units = [(1.0, 1.0, 5000), (0.5, 0.5, 1000), (1.0, 1.0, 1000), (1.0, 2.0, 1000)]
    profile = ModelProfile(tuple(LayerCost(f"l{i}", forward_s=f, backward_s=b, activation_bytes=a, input_bytes=0,
                                           output_bytes=100, param_bytes=1000, optimizer_bytes=0)
                                 for i, (f, b, a) in enumerate(units)))
    cl = Cluster(2, 8050, 1000.0, 10000.0)
    best, best_plan = exhaustive(profile, cl, 1, "1f1b")
    assert best_plan is not None and best_plan.boundaries == (0, 1, 4)
    found = search(profile, cl, microbatches=1, schedule="1f1b", method="vpipe")
    assert found.estimate.feasible and math.isclose(found.estimate.iteration_s, best, rel_tol=1e-9)
    cm = CostModel(profile, cl, 1, "1f1b")
    oracle = StageOracle(cm)
    assert oracle(0, 0, 3).deficit > oracle(0, 0, 2).deficit > 1  # progress the search can see
    with pytest.raises(InfeasiblePlan) as err:  # nothing fits in 5,000 bytes: the bytes it lacks, not a placeholder
        search(profile, Cluster(2, 5000, 1000.0, 10000.0), microbatches=1, schedule="1f1b", method="vpipe")
    assert err.value.missing_bytes > 1


def test_vpipe_climbs_again_from_a_fitting_cover_where_the_shortfall_plateaus() -> None:
    """Found by hypothesis next: unit 1's output (2,100 bytes) holds stage 0 over by 50 bytes whether it ends after
    unit 1 or unit 2, so shedding a layer shows no progress; only (0, 1, 4) fits, and the fallback cover finds it."""
    units = [(1.0, 1.0, 100), (0.5, 0.5, 2100), (1.0, 1.0, 100), (1.0, 2.0, 100)]
    profile = ModelProfile(tuple(LayerCost(f"l{i}", forward_s=f, backward_s=b, activation_bytes=1000, input_bytes=0,
                                           output_bytes=out, param_bytes=1000, optimizer_bytes=0)
                                 for i, (f, b, out) in enumerate(units)))
    cl = Cluster(2, 6050, 1000.0, 10000.0)
    best, best_plan = exhaustive(profile, cl, 1, "1f1b")
    assert best_plan is not None and best_plan.boundaries == (0, 1, 4)
    cm = CostModel(profile, cl, 1, "1f1b")
    oracle = StageOracle(cm)
    assert oracle(0, 0, 2).deficit == oracle(0, 0, 3).deficit > 0  # the plateau the climb cannot see across
    assert fitting_cover(cm, oracle) == (0, 1, 4)
    found = search(profile, cl, microbatches=1, schedule="1f1b", method="vpipe")
    assert found.estimate.feasible and math.isclose(found.estimate.iteration_s, best, rel_tol=1e-9)


def test_infeasible_names_stage_bytes_and_remedies() -> None:
    profile = workload("bert-24")
    cl = cluster("rtx2080ti", 2, memory_bytes=2 * 2**30)
    with pytest.raises(InfeasiblePlan) as err:
        plan(profile, cl, microbatches=4, method="pipedream")
    assert err.value.missing_bytes > 0 and "stage" in str(err.value) and "vpipe" in str(err.value)
    with pytest.raises(InfeasiblePlan) as err2:
        plan(profile, cluster("rtx2080ti", 2, memory_bytes=2**20), microbatches=4, method="optimal")
    assert "more stages" in str(err2.value) and err2.value.stage in (0, 1)


def test_bad_method_and_stage_count() -> None:
    profile = random_chain(4)
    with pytest.raises(PlanError, match="unknown planning method 'magic'"):
        plan(profile, Cluster(2, 10**12, 1e9, 1e9), microbatches=2, method="magic")
    with pytest.raises(PlanError, match="cannot split 4 layers into 5 stages"):
        plan(profile, Cluster(5, 10**12, 1e9, 1e9), microbatches=2)
    with pytest.raises(PlanError, match="microbatches"):
        plan(profile, Cluster(2, 10**12, 1e9, 1e9), microbatches=0)


def _curved(layers: int = 8, size: int = 4) -> ModelProfile:
    """Layers twice as efficient per sample at 8 samples as at 2 (a measured-looking curve), 1 MB of activations
    per sample each."""
    mb = 1 << 20
    return ModelProfile(tuple(
        LayerCost(f"l{i}", 4e-3, 8e-3, 4 * mb, mb, mb // 8, 1 << 20, 2 << 20,
                  ((1, 2e-3, 4e-3), (2, 2.5e-3, 5e-3), (8, 6e-3, 12e-3), (16, 12e-3, 24e-3)))
        for i in range(layers)), "curved", microbatch_size=size)


def test_the_planner_chooses_the_microbatch_count_for_a_global_batch() -> None:
    from vpipe_lab.core.cost import scaling

    profile = _curved()
    roomy = Cluster(2, 1 << 34, 1e10, 1e10)
    found = search(profile, roomy, batch_size=32, method="vpipe")
    tried = dict(found.candidates)
    assert set(tried) == {1, 2, 4, 8, 16, 32} and all(t is not None for t in tried.values())
    assert found.estimate.iteration_s == min(t for t in tried.values() if t is not None)
    assert found.microbatch_size == 32 // found.plan.microbatches
    fixed = search(scaling.at(profile, 32 // found.plan.microbatches), roomy,
                   microbatches=found.plan.microbatches, method="vpipe")
    assert fixed.estimate.iteration_s == pytest.approx(found.estimate.iteration_s)
    # Under a tight budget large micro-batches stop fitting for everything kept; vPipe still fits them by swapping
    # and recomputing, so it can use larger micro-batches than PipeDream, and at least as fast.
    tight = Cluster(2, 60 << 20, 1e10, 1e10)
    dream = search(profile, tight, batch_size=32, method="pipedream")
    vpipe = search(profile, tight, batch_size=32, method="vpipe")
    assert None in dict(dream.candidates).values()
    assert vpipe.estimate.iteration_s <= dream.estimate.iteration_s
    assert vpipe.microbatch_size >= dream.microbatch_size  # type: ignore[operator]


def test_bad_batch_requests_are_refused() -> None:
    profile = _curved()
    cluster = Cluster(2, 1 << 34, 1e10, 1e10)
    with pytest.raises(PlanError, match="either microbatches"):
        search(profile, cluster, microbatches=4, batch_size=32)
    with pytest.raises(PlanError, match="give microbatches"):
        search(profile, cluster)
    with pytest.raises(PlanError, match="do not divide"):
        search(profile, cluster, batch_size=32, counts=[3])
    with pytest.raises(InfeasiblePlan, match="any micro-batch count"):
        search(profile, Cluster(2, 1 << 20, 1e10, 1e10), batch_size=32, method="pipedream")


def test_auto_plans_every_schedule_and_keeps_the_fastest() -> None:
    """schedule='auto': every schedule is planned; ZBV, then ZB-H1, win on their smaller bubbles until the runtime's
    overhead per step outweighs them (they run three steps per micro-batch, not two); a budget only 1F1B fits leaves
    them out."""
    from vpipe_lab.core import schedules

    profile = ModelProfile(tuple(LayerCost(f"l{i}", 1e-3, 2e-3, 1 << 20, 1 << 16, 1 << 16, 1 << 20) for i in range(8)))
    roomy = Cluster(4, 1 << 34, 1e10, 1e12)
    found = search(profile, roomy, microbatches=8, schedule="auto")
    # 8 layers on 4 stages: interleaving fits 2 chunks per stage, not 3 or 4
    assert [s for s, _ in found.schedules] == [*schedules.names()[:4], "interleaved-1f1b V=2", "zbv", "dualpipev"]
    assert found.plan.schedule == "zbv"  # its bubble is the smallest: (K - 1) chunk-steps without W
    times = dict(found.schedules)
    assert times["zbv"] < times["zb-h1"] < times["interleaved-1f1b V=2"] < times["1f1b"]  # type: ignore[operator]
    assert times["zbv"] < times["dualpipev"] < times["interleaved-1f1b V=2"]  # type: ignore[operator]  # (not pipedream)
    assert found.estimate.iteration_s == min(t for _, t in found.schedules if t is not None)
    costly = Cluster(4, 1 << 34, 1e10, 1e12, step_overhead_s=1e-3)  # at M = 32 the bubble is small
    assert search(profile, roomy, microbatches=32, schedule="auto").plan.schedule == "zbv"
    assert search(profile, costly, microbatches=32, schedule="auto").plan.schedule not in (
        "zb-h1", "interleaved-1f1b", "zbv")
    wide = ModelProfile(profile.layers * 2)  # 16 layers: 4 chunks per stage halve the fill and drain again
    wide_times = dict(search(wide, roomy, microbatches=8, schedule="auto").schedules)
    assert min(wide_times, key=lambda s: wide_times[s] or 1e9) == "zbv"  # type: ignore[operator]
    assert wide_times["interleaved-1f1b V=4"] < wide_times["interleaved-1f1b V=2"]  # type: ignore[operator]
    # exactly what stage 0 needs with everything kept under 1F1B: GPipe's M micro-batches in flight do not fit, and
    # ZB-H1's waiting micro-batch fits only on another partition, slower than 1F1B's even one
    cm = CostModel(profile, roomy, 8, "1f1b")
    tight = Cluster(4, cm.keep_all_bytes(0, 0, 2), 1e10, 1e12)
    assert cm.keep_all_bytes(0, 0, 2) < CostModel(profile, roomy, 8, "zb-h1").keep_all_bytes(0, 0, 2)
    pipedream = search(profile, tight, microbatches=8, schedule="auto", method="pipedream-flush")
    tried = dict(pipedream.schedules)
    assert tried["gpipe"] is None and tried["zb-h1"] is not None and tried["1f1b"] is not None
    assert tried["interleaved-1f1b V=2"] is None  # stage 0 holds 6 chunk-forwards of a layer each
    # ZBV holds exactly 1F1B's first-stage activations on every rank (8 one-layer chunk-forwards), so it fits, and
    # wins; the cost model counts what the transfers hold (sent tensors, posted receives) and the rest of the batch on
    # stage 0 for 1F1B, not yet for ZBV
    assert pipedream.plan.schedule == "zbv"
    assert max(pipedream.estimate.peak_bytes) == tight.budgets[0] - cm.comm_bytes(0, 0, 2) - cm.batch_bytes(0)
    assert pipedream.estimate.iteration_s < tried["1f1b"] < tried["zb-h1"]  # type: ignore[operator]
    with pytest.raises(InfeasiblePlan, match="no schedule fits"):
        search(profile, Cluster(4, 1 << 20, 1e10, 1e12), microbatches=8, schedule="auto", method="pipedream-flush")


def test_optimal_is_optimal_by_the_estimate_on_small_random_chains_under_a_binding_budget() -> None:
    """4 units, 3 stages, 4 micro-batches, GPipe (where 'optimal' returned 0.179 s against a feasible 0.162 s by the
    same estimate when it decided fit by its additive count), at budgets that bind: equal to exhaustive search."""
    checked = 0
    for seed in range(40):
        profile = random_chain(4, seed=seed)
        cl = binding_budget(profile, 3, 4, "gpipe", 0.3 + 0.02 * seed)
        best, _ = exhaustive(profile, cl, 4, "gpipe")
        if math.isinf(best):
            continue
        found = search(profile, cl, microbatches=4, schedule="gpipe", method="optimal")
        assert found.estimate.feasible and math.isclose(found.estimate.iteration_s, best, rel_tol=1e-9), seed
        checked += 1
    assert checked >= 20


def test_vpipe_is_within_two_percent_of_exhaustive_search_on_small_random_chains_under_binding_budgets() -> None:
    """vPipe's search (the bottleneck-move partition, vPipe's memory rule, the found stages' plans settled by the
    branch-and-bound) against every split and policy, by the estimate the user is shown: a plan wherever one fits,
    and within 2% of the best in geometric mean (it was 0.8% with 5 of 155 missed before the settle; the one
    instance over 2% is a partition the bottleneck moves do not reach)."""
    import random

    rng = random.Random(0)
    ratios: list[float] = []
    for seed in range(60):
        n, schedule = rng.randint(3, 5), rng.choice(["gpipe", "1f1b"])
        k, m = rng.randint(1, min(3, n)), rng.choice([2, 4, 8])
        profile = random_chain(n, seed=seed)
        cl = binding_budget(profile, k, m, schedule, rng.uniform(0.2, 1.0))
        best, _ = exhaustive(profile, cl, m, schedule)
        if math.isinf(best):
            continue
        found = search(profile, cl, microbatches=m, schedule=schedule, method="vpipe").estimate
        assert found.feasible, seed
        ratios.append(found.iteration_s / best)
    assert len(ratios) >= 40 and min(ratios) >= 1 - 1e-9
    assert math.exp(sum(map(math.log, ratios)) / len(ratios)) <= 1.02
