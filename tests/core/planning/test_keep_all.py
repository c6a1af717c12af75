import itertools
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.strategies import problems
from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.plan import Policy
from vpipe_lab.core.planning import keep_all
from vpipe_lab.core.profile import Cluster, ModelProfile


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_layers=7), st.sampled_from(["1f1b", "gpipe", "pipedream"]))
def test_the_partition_has_the_smallest_bottleneck_of_every_all_kept_split_that_fits(
        case: tuple[ModelProfile, Cluster, int, str], schedule: str) -> None:
    """Against every split of the layers: the same bottleneck (None exactly when no split fits with everything
    kept by the estimate's peak; under PipeDream the stashed weights count), and the bisected cover that bounds the
    search fits too."""
    profile, cluster, m, _ = case
    cm = CostModel(profile, cluster, m, schedule)
    n, k = cm.num_layers, cm.stages

    def bottleneck(bounds: tuple[int, ...]) -> float:
        if not cm.estimate(cm.plan(bounds, (Policy.KEEP,) * n)).feasible:  # by the numbers the user is shown
            return math.inf
        return max(sum(cm.base_times(s, bounds[s], bounds[s + 1])) for s in range(k))

    best = min(bottleneck((0, *cuts, n)) for cuts in itertools.combinations(range(1, n), k - 1))
    found, _ = keep_all.partition(cm)
    cover = keep_all.cover(cm)
    if math.isinf(best):
        assert found is None and cover is None
        return
    assert found is not None and math.isclose(bottleneck(found), best, rel_tol=1e-9)
    assert cover is None or best <= bottleneck(cover) < math.inf  # a greedy bound: when it finds one, it fits
