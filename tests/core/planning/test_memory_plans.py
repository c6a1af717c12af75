import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.plan import Policy
from vpipe_lab.core.planning.memory_plans import StageProblem, greedy
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile


@st.composite
def stage_problems(draw: st.DrawFn) -> tuple[CostModel, StageProblem]:
    n = draw(st.integers(1, 7))
    # Repeated layers exercise the symmetry breaking of identical blocks.
    kinds = draw(st.lists(st.tuples(st.integers(1, 50), st.integers(0, 50), st.floats(0.05, 2.0)), min_size=1,
                          max_size=3))
    out = []
    for i in range(n):
        a, x, f = kinds[draw(st.integers(0, len(kinds) - 1))]
        out.append(LayerCost(f"l{i}", f, 2 * f, a * 1000, min(a, x) * 1000, 10, 10))
    profile = ModelProfile(tuple(out))
    m = draw(st.integers(1, 6))
    probe = CostModel(profile, Cluster(1, 10**12, 1e3, 1e9), m, "gpipe")
    keep = probe.keep_all_bytes(0, 0, n)
    # swaps beside the compute (GPU) or on the compute thread (CPU: additive, nothing hides)
    cluster = Cluster(1, max(1, int(keep * draw(st.floats(0.05, 1.1)))), draw(st.sampled_from([1e3, 1e4, 1e5])), 1e9,
                      swap_overlaps=draw(st.booleans()))
    cm = CostModel(profile, cluster, m, "gpipe")
    return cm, StageProblem.of(cm, 0, 0, n)


def brute(cm: CostModel, p: StageProblem) -> float:
    """The cheapest memory plan that fits by the estimate's own peak (what the user is shown); the planners'
    additive count (``planned_peak_bytes``) never understates it."""
    n = len(p.activation)
    best = math.inf
    for pols in itertools.product(list(Policy), repeat=n):
        cost = cm.stage_cost(0, 0, n, pols)
        assert cm.planned_peak_bytes(0, 0, n, pols) >= cost.peak_bytes
        if cost.peak_bytes <= cm.budget(0):
            best = min(best, cost.backward_s - cm.backward_compute_s(0, n))
    return best


def extra_of(cm: CostModel, policies: tuple[Policy, ...]) -> tuple[float, int]:
    n = len(policies)
    cost = cm.stage_cost(0, 0, n, policies)
    return cost.backward_s - cm.backward_compute_s(0, n), cost.peak_bytes


def test_greedy_swaps_largest_first_while_hidden() -> None:
    layers = (LayerCost("small", 1.0, 2.0, 100, 10, 1, 1), LayerCost("big", 1.0, 2.0, 1000, 10, 1, 1))
    cm = CostModel(ModelProfile(layers), Cluster(1, 4 * 100 + 2 * 1000 + 4 + 100, 1e6, 1e9), 4, "gpipe")
    sol = greedy(StageProblem.of(cm, 0, 0, 2))
    assert sol is not None and sol.policies == (Policy.KEEP, Policy.SWAP) and sol.extra_s == 0.0


def test_greedy_recomputes_when_swap_cannot_hide() -> None:
    layers = (LayerCost("a", 1.0, 2.0, 1000, 10, 1, 1),)
    # Recompute: 4 inputs of 10 plus the layer's 1000 while it is rebuilt; swap would need 2 x 1000 resident.
    cm = CostModel(ModelProfile(layers), Cluster(1, 1100, swap_bandwidth=1.0, link_bandwidth=1e9), 4, "gpipe")
    sol = greedy(StageProblem.of(cm, 0, 0, 1))
    assert sol is not None and sol.policies == (Policy.RECOMPUTE,) and sol.extra_s == 1.0


@settings(max_examples=100, deadline=None)
@given(stage_problems(), st.lists(st.tuples(st.integers(0, 6), st.sampled_from(list(Policy))), max_size=12))
def test_the_rule_s_tally_prices_a_layer_s_alternative_as_setting_it_would(case: tuple[CostModel, StageProblem],
                                                                           moves: list[tuple[int, Policy]]) -> None:
    """``excess_with`` (the greedy asks it for every layer it weighs) answers without changing the tally, and equals
    what setting the policy and reading ``excess`` gives, whatever was set before (the largest rebuild held moving)."""
    from vpipe_lab.core.planning.memory_plans import _Tally

    _, p = case
    n = len(p.activation)
    tally = _Tally(p)
    for i, policy in moves:
        i %= n
        for j in range(n):
            for choice in Policy:
                before = (tally.excess(), list(tally.policies))
                asked = tally.excess_with(j, choice)
                assert (tally.excess(), tally.policies) == before
                old = tally.policies[j]
                tally.set(j, choice)
                assert asked == tally.excess()
                tally.set(j, old)
        tally.set(i, policy)
        assert tally.top == max(tally.rebuilt, default=0)
