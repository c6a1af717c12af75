"""Replica shares of a batch (the gradient average runs in tests/integration/test_replicas.py, across processes)."""

from __future__ import annotations

import pytest
import torch

from vpipe_lab.runtime.model.batches import split
from vpipe_lab.runtime.training.place import Place
from vpipe_lab.runtime.training.replicas import DataParallel, shard


def test_each_replica_takes_its_contiguous_share_and_together_they_are_the_micro_batches() -> None:
    x = {"ids": torch.arange(16).reshape(8, 2), "mask": torch.ones(8, 2)}
    shares = [shard(x, r, 2, "inputs") for r in range(2)]
    assert torch.equal(shares[0]["ids"], x["ids"][:4]) and torch.equal(shares[1]["ids"], x["ids"][4:])
    # replica r's micro-batch m is the global batch's micro-batch r * M + m
    per_replica = [mb["ids"] for share in shares for mb in split(share, 2, "inputs")]
    assert all(torch.equal(a, b["ids"]) for a, b in zip(per_replica, split(x, 4, "inputs")))
    assert shard(x, 0, 1, "inputs") is x and shard(None, 1, 2, "targets") is None


def test_a_batch_that_does_not_split_is_refused() -> None:
    with pytest.raises(ValueError, match="batch size 3, which does not split evenly across 2 data-parallel ranks"):
        shard(torch.zeros(3, 2), 0, 2, "inputs")


def test_one_replica_needs_no_group() -> None:
    dp = DataParallel(torch.device("cpu"), Place(1, stages=2))
    g = torch.ones(3)
    dp.average([g])
    assert dp.group is None and dp.shard_mesh is None and torch.equal(g, torch.ones(3))
