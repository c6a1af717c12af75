"""Padded language-model batches: the loss as one forward of the whole batch computes it. With ignored positions
(-100), each micro-batch's loss is normalised by the batch's count of items, agreed before its micro-batches run:
a model's own loss given ``num_items_in_batch``, a user loss that takes it, the default loss, and a user loss that
does not (weighted by its share of the count); short last batches too. Losses and every tensor equal one forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import vpipe_lab
from tests.models import zoo

pytestmark = pytest.mark.slow
ITERATIONS = 3


def padded(iteration: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded rows of different lengths (some very short), labels -100 on the padding; a short last batch
    every third iteration (6 rows instead of 8)."""
    g = torch.Generator().manual_seed(7_000 + iteration)
    rows = 6 if iteration % 3 == 2 else zoo.BATCH
    ids = torch.randint(1, zoo.VOCAB, (rows, zoo.SEQ + 1), generator=g)
    lengths = torch.randint(2, zoo.SEQ + 1, (rows,), generator=g)
    mask = (torch.arange(zoo.SEQ)[None, :] < lengths[:, None]).long()
    targets = ids[:, 1:].masked_fill(mask == 0, -100)
    return {"input_ids": ids[:, :-1], "attention_mask": mask}, targets


def own_loss_data(iteration: int) -> tuple[dict[str, torch.Tensor], None]:
    inputs, _ = padded(iteration)
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)  # the model shifts them itself
    return {**inputs, "labels": labels}, None


def counting_loss(output: Any, target: torch.Tensor, num_items_in_batch: int) -> torch.Tensor:
    """A user loss as transformers' Trainer takes one: summed, over the batch's count."""
    logits = output.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, zoo.VOCAB), target.reshape(-1), reduction="sum",
                                             ignore_index=-100) / num_items_in_batch


def mean_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """A user loss that knows nothing of the batch: the mean over its own counted tokens."""
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, zoo.VOCAB), target.reshape(-1))


def one_forward(model_fn: Callable[[], torch.nn.Module], data: Callable[[int], Any], loss: Callable[..., Any] | None
                ) -> tuple[torch.nn.Module, list[float]]:
    """Plain PyTorch, one forward of each whole batch (the yardstick), AdamW."""
    torch.manual_seed(0)
    model = model_fn().train()
    opt = zoo.adamw(model.parameters())
    losses = []
    for it in range(ITERATIONS):
        inputs, targets = data(it)
        out = model(**inputs)
        if targets is None:
            value = out.loss
        else:
            value = torch.nn.functional.cross_entropy(out.logits.reshape(-1, zoo.VOCAB), targets.reshape(-1))
        value.backward()
        losses.append(float(value))
        opt.step()
        opt.zero_grad()
    return model, losses


@pytest.mark.parametrize(("model", "data", "loss"), [
    (zoo.llama, own_loss_data, None),  # the model's own loss, given num_items_in_batch
    (zoo.gpt2, padded, None),  # the default loss over targets with ignored positions
    (zoo.gpt2, padded, counting_loss),  # a user loss taking num_items_in_batch
    (zoo.llama, padded, mean_loss),  # a user loss that does not: weighted by its share of the count
], ids=["own-loss", "default-loss", "counting-loss", "mean-loss"])
def test_padded_batches_train_as_one_forward(model: Any, data: Any, loss: Any) -> None:
    with vpipe_lab.launch(model, data, stages=2, microbatches=4, loss=loss, optimizer=zoo.adamw, device="cpu",
                          timeout=120) as session:
        session.run(ITERATIONS)
        session.wait(timeout=300)
        losses = list(session.metrics.iterations["loss"])
        state = session.state_dict()
    plain, expected = one_forward(model, data, loss)
    assert losses == pytest.approx(expected, rel=2e-5)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=5e-5, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
