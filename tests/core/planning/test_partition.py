import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.planning.partition import Objective, balanced, pareto_dp, uniform


def test_uniform() -> None:
    assert uniform(10, 3) == (0, 4, 7, 10)
    assert uniform(3, 3) == (0, 1, 2, 3)
    with pytest.raises(PlanError, match="cannot split 2 layers into 3 stages"):
        uniform(2, 3)


def brute_min_max(times: list[float], k: int) -> float:
    n = len(times)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        best = min(best, max(sum(times[b[i]:b[i + 1]]) for i in range(k)))
    return best


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0.01, 10), min_size=1, max_size=9), st.integers(1, 4))
def test_balanced_is_min_max(times: list[float], k: int) -> None:
    k = min(k, len(times))
    b = balanced(times, k)
    assert b[0] == 0 and b[-1] == len(times) and all(x < y for x, y in itertools.pairwise(b))
    got = max(sum(times[b[i]:b[i + 1]]) for i in range(k))
    assert math.isclose(got, brute_min_max(times, k), rel_tol=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 10), min_size=2, max_size=8), st.lists(st.floats(0, 3), min_size=9, max_size=9),
       st.integers(1, 3), st.integers(1, 6))
def test_pareto_dp_is_exact_with_boundary_costs(times: list[float], comm: list[float], k: int, m: int) -> None:
    """Stage time = its compute plus a cost per boundary; the DP must match brute force for every objective."""
    n = len(times)
    k = min(k, n)
    prefix = [0.0, *itertools.accumulate(times)]

    def stage(s: int, lo: int, hi: int) -> tuple[float, float]:
        return prefix[hi] - prefix[lo] + (comm[hi] if s < k - 1 else 0.0), (comm[lo] if s > 0 else 0.0)

    for kind in ("bottleneck", "1f1b", "gpipe"):
        obj = Objective(kind, m)
        best = math.inf
        for cuts in itertools.combinations(range(1, n), k - 1):
            b = (0, *cuts, n)
            key = obj.start()
            for s in range(k):
                key = obj.extend(key, *stage(s, b[s], b[s + 1]))
            best = min(best, obj.value(key))
        result = pareto_dp(n, k, stage, prefix, obj)
        assert math.isclose(result.value, best, rel_tol=1e-9), kind
        # With the optimum as the bound to beat, nothing strictly better exists.
        assert pareto_dp(n, k, stage, prefix, obj, upper=best * (1 - 1e-9)).boundaries is None


def test_pareto_dp_reports_infeasible() -> None:
    result = pareto_dp(3, 2, lambda s, lo, hi: None, [0.0, 1.0, 2.0, 3.0], Objective("1f1b", 2))
    assert result.boundaries is None and math.isinf(result.value)
