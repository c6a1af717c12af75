"""Batches: splitting any structure into micro-batches, iterable sources, trees across processes."""

import pytest
import torch

from vpipe_lab.runtime.model.batches import Source, batch_size, describe, loss_with_check, rebuild, split


def test_split_any_structure_into_equal_microbatches() -> None:
    batch = {"input_ids": torch.arange(8).reshape(4, 2), "attention_mask": torch.ones(4, 2), "flag": True,
             "extra": (torch.zeros(4), None)}
    parts = split(batch, 2, "inputs")
    assert len(parts) == 2 and parts[1]["input_ids"].tolist() == [[4, 5], [6, 7]]
    assert parts[0]["flag"] is True and parts[0]["extra"][1] is None and parts[0]["extra"][0].shape == (2,)
    assert len(split((torch.zeros(8, 2), torch.zeros(8)), 4, "inputs")) == 4
    assert batch_size(batch) == 4


def test_a_batch_that_does_not_divide_splits_into_sizes_one_apart() -> None:
    """A DataLoader's short last batch (drop_last=False): 6 samples in 4 micro-batches are 2, 2, 1, 1."""
    inputs = {"x": torch.arange(6), "mask": torch.ones(6, 3)}
    parts = split(inputs, 4, "inputs")
    assert [p["x"].tolist() for p in parts] == [[0, 1], [2, 3], [4], [5]]
    assert [batch_size(p) for p in parts] == [2, 2, 1, 1] and parts[3]["mask"].shape == (1, 3)


@pytest.mark.parametrize(("batch", "match"), [
    (torch.zeros(3, 2), "batch size 3, fewer samples than the 4 micro-batches"),
    ((torch.zeros(4), torch.zeros(8)), "different batch sizes"),
    ("text", "hold no tensor"),
])
def test_split_refuses_what_does_not_split(batch: object, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        split(batch, 4, "inputs")


def test_iterable_source_reads_in_order_restarts_epochs_and_resumes() -> None:
    data = [(torch.full((2,), float(i)), torch.zeros(2)) for i in range(3)]
    src = Source(data, 0)
    got = [int(src.get(i)[0][0]) for i in range(7)]
    assert got == [0, 1, 2, 0, 1, 2, 0]
    assert int(src.get(6)[0][0]) == 0  # a retried iteration gets the same batch
    resumed = Source(data, 4)
    assert int(resumed.get(4)[0][0]) == 1  # batch 4 of the run: the second of the second epoch
    with pytest.raises(ValueError, match="read in order"):
        resumed.get(9)
    with pytest.raises(ValueError, match="yields no batches"):
        Source([], 0).get(0)


def test_callable_source_and_labels_in_inputs() -> None:
    assert Source(lambda i: (torch.tensor([i]), None), 5).get(5)[0].item() == 5
    inputs, targets = Source(lambda i: {"input_ids": torch.zeros(2), "labels": torch.zeros(2)}, 0).get(0)
    assert targets is None and "labels" in inputs
    with pytest.raises(TypeError, match="pairs"):
        Source(lambda i: torch.zeros(2), 0).get(0)


def test_trees_cross_as_json_and_tensors() -> None:
    tree = {"y": torch.arange(6).reshape(2, 3), "w": (1.5, None, "x")}
    desc, tensors = describe(tree)
    back = rebuild(desc, tensors)
    assert torch.equal(back["y"], tree["y"]) and back["w"] == (1.5, None, "x")
    zeros = rebuild(desc)
    assert zeros["y"].dtype == torch.int64 and zeros["y"].shape == (2, 3)
    with pytest.raises(TypeError, match="cannot cross"):
        describe({"bad": object()})


def test_loss_must_be_a_scalar() -> None:
    loss = loss_with_check(lambda out, y: out * 2, lambda out: out)
    assert loss(torch.tensor([3.0]), None).shape == ()
    with pytest.raises(ValueError, match="scalar"):
        loss(torch.ones(3), None)


def test_what_an_iterable_raises_is_what_the_user_sees_and_the_batch_is_not_counted_as_read() -> None:
    """A data source that raises at item 5 used to be reported as 'asked for batch 5, next is 6', its own error
    lost; now its error is raised, and asking for batch 5 again asks the iterable again."""

    class Flaky:
        def __init__(self) -> None:
            self.fail = True

        def __iter__(self):  # type: ignore[no-untyped-def]
            for i in range(8):
                if i == 5 and self.fail:
                    self.fail = False
                    raise OSError("the shard on /data/5 is gone")
                yield torch.full((2, 1), float(i)), None

    source = Source(Flaky(), 0)
    for i in range(5):
        source.get(i)
    with pytest.raises(OSError, match="the shard on /data/5 is gone"):
        source.get(5)
    assert float(source.get(5)[0][0, 0]) == 0.0  # the iterable began again (a new epoch): no 'next is 6'
