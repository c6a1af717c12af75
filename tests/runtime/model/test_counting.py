"""Counting a batch's items where labels ignore positions: per micro-batch, shifted for a causal LM's own loss, and
which losses take the batch's count."""

from __future__ import annotations

import torch

from tests.models import zoo
from vpipe_lab.runtime.engine.executor import default_loss
from vpipe_lab.runtime.model import counting


def test_counts_follow_the_loss() -> None:
    labels = torch.tensor([[5, 6, -100], [7, -100, -100], [1, 2, 3], [-100, 4, 5]])
    assert counting.counts(None, labels, 2, counting.Rule()) == [3, 5]
    inputs = {"input_ids": labels.clamp(min=0), "labels": labels}  # the model's own loss: a causal LM shifts
    assert counting.counts(inputs, None, 2, counting.Rule(shift=True)) == [1, 4]
    assert counting.counts(None, torch.tensor([[1, 2], [3, 4]]), 2, counting.Rule()) is None  # nothing ignored
    assert counting.counts(None, torch.randn(4, 3), 2, counting.Rule()) is None  # not labels


def test_which_losses_and_models_count() -> None:
    assert counting.names_count(default_loss)
    assert not counting.names_count(lambda out, target: out)
    assert counting.Rule.of(zoo.gpt2()).shift and not counting.Rule.of(zoo.bert()).shift
    assert counting.Rule.of(None) == counting.Rule()


def test_the_default_loss_over_the_batch_count_sums_to_the_batch_mean() -> None:
    logits = torch.randn(4, 3, 7)
    target = torch.tensor([[1, 2, -100], [3, -100, -100], [4, 5, 6], [-100, 0, 1]])
    whole = default_loss(logits, target)
    parts = [default_loss(logits[i:i + 2], target[i:i + 2], num_items_in_batch=8) for i in (0, 2)]
    torch.testing.assert_close(sum(parts), whole)
