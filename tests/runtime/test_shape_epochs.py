"""Shape epochs on one rank: what rank 0 describes, and what every rank takes from it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.integration import zoo
from vpipe_lab.runtime.model.capture import capture
from vpipe_lab.runtime.recapture import Recaptures
from vpipe_lab.runtime.shape_epochs import ShapeEpochs


def epochs(replicas: int = 1) -> ShapeEpochs:
    peer = SimpleNamespace(reset_shapes=lambda: None)
    return ShapeEpochs(peer, Recaptures(zoo.length_switch, None, 0), 0, replicas, 1)  # type: ignore[arg-type]


def test_a_short_batch_is_described_as_uneven_micro_batches_and_their_distinct_shapes() -> None:
    e = epochs()
    doc = e.describe({"ids": torch.zeros(6, 12, dtype=torch.long)}, 4)
    assert doc["sizes"] == [2, 2, 1, 1] and len(doc["shapes"]) == 2
    chain = capture(zoo.length_switch(), torch.zeros(2, 16, dtype=torch.long))
    fits = e.describe(torch.zeros(4, 16, dtype=torch.long), 2)
    assert e.agree(fits, chain) is None  # the captured graph takes these: nothing to adopt
    assert e.sizes == [2, 2] and not e.renew and not e.uneven and e.example == fits["shapes"][0]
    assert e.agree(e.describe(torch.zeros(4, 12, dtype=torch.long), 2), chain) is not None  # the other branch
    e.start()
    assert e.renew and e.agreed is None


def test_what_cannot_be_split_is_refused_on_every_rank_with_the_reason() -> None:
    e = epochs()
    doc = e.describe(torch.zeros(3, 4), 4)
    assert "fewer samples than the 4 micro-batches" in doc["error"]
    with pytest.raises(ValueError, match="fewer samples"):
        e.agree(doc, capture(zoo.length_switch(), torch.zeros(2, 16, dtype=torch.long)))
    assert "evenly across 2 pipeline replicas" in epochs(replicas=2).describe(torch.zeros(5, 4), 1)["error"]


def test_a_changed_batch_is_noticed_against_the_one_the_epoch_began_with() -> None:
    e = epochs()
    assert not e.changed(torch.zeros(2, 4), None)  # nothing agreed yet
    from vpipe_lab.runtime.model.batches import signature

    e.agreed = signature(torch.zeros(2, 4), None)
    assert not e.changed(torch.ones(2, 4), None) and e.changed(torch.zeros(3, 4), None)
