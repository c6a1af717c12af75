"""A worker's place in the mesh: global rank = (replica x shards + shard) x stages + stage."""

from __future__ import annotations

import pytest

from vpipe_lab.runtime.training.place import Place


def test_every_rank_has_one_place_and_a_pipelines_stages_are_consecutive() -> None:
    places = [Place(r, stages=2, shards=2, replicas=3) for r in range(12)]
    assert {(p.stage, p.shard, p.replica) for p in places} == {(s, k, r) for s in range(2) for k in range(2)
                                                              for r in range(3)}
    p = Place(7, stages=2, shards=2, replicas=3)  # dp rank 3: replica 1, shard 1; stage 1
    assert (p.stage, p.dp, p.shard, p.replica, p.dps, p.world) == (1, 3, 1, 1, 6, 12)
    assert p.rank_of(0) == 6 and p.rank_of(1, dp=0) == 1
    assert p.describe() == "stage 1 shard 1 of replica 1" and Place(1, 2).describe() == "stage 1"
    with pytest.raises(ValueError, match="rank 12 is outside a job of 2 stages x 2 shards x 3 replicas"):
        Place(12, 2, 2, 3)
