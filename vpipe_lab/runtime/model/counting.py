"""The loss as one process computes it when targets have ignored positions: counted items per micro-batch.

A language model's batch is padded: its labels (or targets) carry ``-100`` where nothing is predicted, and one
forward of the batch takes the mean over the batch's counted tokens. The mean of the micro-batches' means (each
counted by its samples) is not that mean. So rank 0, which reads the data, counts each micro-batch's items before they
run (``counts``), and the stage that computes the loss normalises by the whole batch's count ``N``:

- a loss function that takes ``num_items_in_batch`` (as transformers' Trainer gives it; the default loss does) gets
  ``N``: each micro-batch's loss is its sum over ``N``;
- any other loss, and a model's own loss from the ``labels`` among its inputs, is the mean over its micro-batch's
  counted items, weighted by ``count / N``. A causal LM counts its labels shifted (the first position predicts
  nothing), as its loss does (``Rule``). The model is not given ``num_items_in_batch`` itself: a count among its
  inputs made torch.export specialise every input's shape.

Either way the losses and the gradients are one forward's of the whole batch (short last batches included); a
micro-batch with nothing counted gives a mean loss of 0/0 there, as it would in one process taking that micro-batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vpipe_lab.runtime.model.batches import split

IGNORE = -100  # torch's and transformers' ignore_index
KEY = "num_items_in_batch"


def names_count(fn: Any) -> bool:
    """Whether ``fn`` names ``num_items_in_batch`` itself (a keyword catch-all may drop it)."""
    try:
        return KEY in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class Rule:
    """How a model's own loss counts its labels: ``shift`` for causal LMs (transformers' ``ForCausalLMLoss``)."""

    shift: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module | None) -> Rule:
        if model is None:
            return cls()
        try:
            loss = getattr(model, "loss_function", None)
        except Exception:  # a property that needs a config the model lacks
            loss = None
        return cls(getattr(loss, "__name__", "") == "ForCausalLMLoss")


def counted(labels: Any, shift: bool) -> torch.Tensor | None:
    """Per sample, the items a loss counts in integer ``labels`` that ignore some positions (None: no label is
    ignored, or these are not labels: every sample then counts as one, as without counting)."""
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dim() < 1:
        return None
    if not bool((labels == IGNORE).any()):
        return None
    kept = labels[..., 1:] if shift and labels.dim() >= 2 else labels
    return (kept != IGNORE).reshape(kept.shape[0], -1).sum(1)


def labels_of(inputs: Any, targets: Any) -> tuple[Any, bool]:
    """What the loss compares against: the targets, or (a model computing its own loss) the inputs' ``labels``;
    and whether it is the latter."""
    if targets is not None:
        return targets, False
    if isinstance(inputs, dict) and "labels" in inputs:
        return inputs["labels"], True
    return None, False


def counts(inputs: Any, targets: Any, microbatches: int, rule: Rule) -> list[int] | None:
    """Each micro-batch's counted items (None when nothing is ignored: samples weigh as before)."""
    labels, own = labels_of(inputs, targets)
    per_sample = counted(labels, rule.shift and own)
    if per_sample is None:
        return None
    return [int(part.sum()) for part in split(per_sample, microbatches, "targets")]


def with_count(loss_fn: Callable[..., torch.Tensor], total: int) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` given the batch's count as ``num_items_in_batch``."""
    def loss(out: Any, target: Any) -> torch.Tensor:
        return loss_fn(out, target, num_items_in_batch=total)

    return loss
