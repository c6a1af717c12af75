import pytest

from vpipe_lab.core.planning.layer_moves import LayerMove, layer_moves, migration_time_s, moved_bytes, owners
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile


def test_owners_and_moves() -> None:
    assert owners((0, 2, 5)) == [0, 0, 1, 1, 1]
    assert layer_moves((0, 2, 5), (0, 3, 5)) == (LayerMove(2, 1, 0),)
    assert layer_moves((0, 1, 2, 6), (0, 4, 5, 6)) == (
        LayerMove(1, 1, 0), LayerMove(2, 2, 0), LayerMove(3, 2, 0), LayerMove(4, 2, 1))
    assert layer_moves((0, 3, 6), (0, 3, 6)) == ()
    with pytest.raises(ValueError, match="differ in layers or stages"):
        layer_moves((0, 3, 6), (0, 6))


def test_bytes_and_time() -> None:
    profile = ModelProfile(tuple(LayerCost(f"l{i}", 1, 1, 1, 1, 1, param_bytes=100, optimizer_bytes=200)
                                 for i in range(4)))
    moves = layer_moves((0, 2, 4), (0, 1, 4))
    assert moved_bytes(moves, profile) == 300
    cluster = Cluster(2, 10**9, 1e9, link_bandwidth=100.0, link_latency_s=0.5)
    assert migration_time_s(moves, profile, cluster) == pytest.approx(0.5 + 3.0)
    assert migration_time_s((), profile, cluster) == 0.0


def test_match_layers_follows_insertions_removals_and_replacements() -> None:
    from vpipe_lab.core.planning.layer_moves import match_layers

    assert match_layers(["a", "b", "c"], ["a", "b", "c"]) == {0: 0, 1: 1, 2: 2}
    assert match_layers(["a", "b", "c"], ["a", "x", "b", "c"]) == {0: 0, 1: None, 2: 1, 3: 2}
    assert match_layers(["a", "b", "c"], ["a", "c"]) == {0: 0, 1: 2}
    assert match_layers(["a", "b", "b", "c"], ["a", "b", "y", "b", "c"]) == {0: 0, 1: 1, 2: None, 3: 2, 4: 3}
