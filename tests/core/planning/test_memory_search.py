"""The exact memory plan of one stage: equal to brute force over every policy on the estimate's own peak, never worse
than vPipe's rule, and its cutoff and node limit."""

import math

from hypothesis import given, settings

from tests.core.planning.test_memory_plans import brute, extra_of, stage_problems
from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.memory_plans import StageProblem, greedy
from vpipe_lab.core.planning.memory_search import exact
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile


@settings(max_examples=150, deadline=None)
@given(stage_problems())
def test_exact_matches_brute_force_and_beats_greedy(case: tuple[CostModel, StageProblem]) -> None:
    cm, p = case
    best = brute(cm, p)
    sol = exact(p)
    g = greedy(p)
    if math.isinf(best):
        assert sol is None and g is None
        return
    assert sol is not None and sol.proven
    extra, peak = extra_of(cm, sol.policies)
    assert peak <= cm.budget(0)
    assert math.isclose(extra, best, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(sol.extra_s, extra, rel_tol=1e-9, abs_tol=1e-12)
    if g is not None:  # the greedy is feasible whenever it answers, and never better than exact
        g_extra, g_peak = extra_of(cm, g.policies)
        assert g_peak <= cm.budget(0) and g_extra >= best - 1e-9


def test_cutoff_and_node_limit() -> None:
    layers = tuple(LayerCost(f"l{i}", 0.1 * (i + 1), 0.2, 1000 * (i + 3), 100, 1, 1) for i in range(12))
    profile = ModelProfile(layers)
    probe = CostModel(profile, Cluster(1, 10**12, 1e3, 1e9), 4, "gpipe")
    cm = CostModel(profile, Cluster(1, probe.keep_all_bytes(0, 0, 12) // 3, 1e3, 1e9), 4, "gpipe")
    p = StageProblem.of(cm, 0, 0, 12)
    best = exact(p)
    assert best is not None and best.proven
    assert exact(p, cutoff=best.extra_s) is None  # nothing strictly below the optimum
    capped = exact(p, node_limit=3)
    assert capped is not None and not capped.proven and capped.extra_s >= best.extra_s
    assert exact(StageProblem.of(CostModel(profile, Cluster(1, 10**12, 1e3, 1e9), 4, "gpipe"), 0, 0, 12)) == \
        greedy(StageProblem.of(CostModel(profile, Cluster(1, 10**12, 1e3, 1e9), 4, "gpipe"), 0, 0, 12))
    assert Plan((0, 12), best.policies, 4, "gpipe").validate()
