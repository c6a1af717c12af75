"""Shape epochs on one rank: what rank 0 describes, and what every rank takes from it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.integration import zoo
from vpipe_lab.runtime.model.capture import capture
from vpipe_lab.runtime.model.data_checks import BadBatch
from vpipe_lab.runtime.recapture import Recaptures
from vpipe_lab.runtime.shape_epochs import ShapeEpochs


def epochs(replicas: int = 1) -> ShapeEpochs:
    peer = SimpleNamespace(reset_shapes=lambda: None)
    return ShapeEpochs(peer, Recaptures(zoo.length_switch, None, 0), 0, replicas, 1)  # type: ignore[arg-type]


def test_a_short_batch_is_described_as_uneven_micro_batches_and_their_distinct_shapes() -> None:
    e = epochs()
    doc = e.describe(torch.zeros(6, 12, dtype=torch.long), 4)
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
    with pytest.raises(BadBatch, match=r"^the inputs have batch size 3") as err:  # said once, not "ValueError: ValueError: ..."
        e.agree(doc, capture(zoo.length_switch(), torch.zeros(2, 16, dtype=torch.long)))
    assert "Error:" not in str(err.value)
    assert "evenly across 2 data-parallel ranks" in epochs(replicas=2).describe(torch.zeros(5, 4), 1)["error"]


def test_a_changed_batch_is_noticed_against_the_one_the_epoch_began_with() -> None:
    e = epochs()
    assert not e.changed(torch.zeros(2, 4), None)  # nothing agreed yet
    from vpipe_lab.runtime.model.batches import signature

    e.agreed = signature(torch.zeros(2, 4), None)
    assert not e.changed(torch.ones(2, 4), None) and e.changed(torch.zeros(3, 4), None)


def test_a_batch_unlike_the_first_is_bad_data_before_any_stage_runs_it() -> None:
    e = epochs()
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert "sizes" in e.describe({"input_ids": ids}, 2, targets=ids)  # the first batch: the layout to keep
    assert "sizes" in e.describe({"input_ids": ids[:, :9]}, 2, targets=ids[:, :9])  # new sizes are no fault
    doc = e.describe({"input_ids": ids.float()}, 2, targets=ids)
    assert doc["bad"] and doc["error"].startswith("inputs['input_ids'] is float32 of shape [4, 16], where the first "
                                                  "batch's was int64 of shape [4, 16]")
    with pytest.raises(BadBatch, match=r"convert it in the data \(e.g. .to\(torch.int64\)\)"):
        e.agree(doc, capture(zoo.length_switch(), torch.zeros(2, 16, dtype=torch.long)))
    assert "no targets" in e.describe({"input_ids": ids}, 2)["error"]
    assert "an unexpected inputs['mask']" in e.describe({"input_ids": ids, "mask": ids}, 2, targets=ids)["error"]
    # an evaluation batch brings inputs alone: only they are checked
    assert "sizes" in e.describe({"input_ids": ids}, 2, with_targets=False)
