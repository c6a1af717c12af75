import itertools

from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.planning.vpipe_search import StageOracle, _candidates, score, vpipe_search
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile
from vpipe_lab.core.workloads import pressured_cluster, random_chain


def test_candidates_are_adjacent_moves() -> None:
    profile = random_chain(12, seed=1)
    cm = CostModel(profile, Cluster(3, 10**12, 1e9, 1e9), 4, "1f1b")
    oracle = StageOracle(cm)
    bounds = (0, 4, 8, 12)
    for cand in _candidates(oracle, bounds, 1):
        assert cand[0] == 0 and cand[-1] == 12 and all(a < b for a, b in itertools.pairwise(cand))
        assert cand != bounds


def test_search_moves_load_off_a_heavy_stage() -> None:
    heavy = [LayerCost(f"h{i}", 5.0, 10.0, 10, 1, 1, 1) for i in range(4)]
    light = [LayerCost(f"l{i}", 1.0, 2.0, 10, 1, 1, 1) for i in range(8)]
    profile = ModelProfile(tuple(heavy + light))
    cm = CostModel(profile, Cluster(3, 10**12, 1e12, 1e12), 8, "1f1b")
    bounds, _, oracle = vpipe_search(cm, (0, 4, 8, 12))
    assert score(cm, oracle, bounds) < score(cm, oracle, (0, 4, 8, 12))
    assert bounds[1] < 4  # the heavy first stage shed layers


def test_search_fixes_a_stage_that_does_not_fit() -> None:
    profile = random_chain(24, seed=5)
    cl = pressured_cluster(profile, 3, 6, pressure=0.45)
    cm = CostModel(profile, cl, 6, "1f1b")
    start = (0, 20, 22, 24)
    oracle = StageOracle(cm)
    before = score(cm, oracle, start)
    bounds, _, _ = vpipe_search(cm, start, oracle)
    after = score(cm, oracle, bounds)
    assert after < before and (before[0] > 0) and after[0] <= before[0]
