"""Batches as PyTorch users have them: from ``data(iteration)`` or any iterable (a DataLoader), split into micro-batches.

Inputs and targets may be a tensor, a tuple or a dict (keyword arguments such as ``input_ids`` and
``attention_mask``), nested as the model likes; every tensor is split along dim 0 into equal micro-batches and other
values are given to every micro-batch as they are. Only rank 0 reads data: the last stage receives the targets.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def split(batch: Any, microbatches: int, what: str) -> list[Any]:
    """``batch`` as ``microbatches`` micro-batches along dim 0 of every tensor: equal ones when the batch size divides,
    else sizes that differ by one (``torch.tensor_split``: a DataLoader's short last batch); each micro-batch's loss is
    then weighted by its share of the samples (``Executor.run``), so the step is the full batch's, as in one process.
    Fewer samples than micro-batches is refused."""
    leaves, spec = pytree.tree_flatten(batch)
    sizes = {int(t.shape[0]) for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if not any(isinstance(t, torch.Tensor) for t in leaves):
        raise TypeError(f"the {what} hold no tensor (got {type(batch).__name__}): give a tensor, a tuple or a dict of "
                        "tensors")
    if len(sizes) > 1:
        raise ValueError(f"the {what} have tensors of different batch sizes {sorted(sizes)} along dim 0; every tensor "
                         "must have the batch on dim 0")
    size = sizes.pop() if sizes else 0
    if size < microbatches:
        raise ValueError(f"the {what} have batch size {size}, fewer samples than the {microbatches} micro-batches "
                         f"to fill: give batches of at least {microbatches} samples (drop_last=True in the DataLoader "
                         "drops a short last batch), or use fewer micro-batches")
    parts = [torch.tensor_split(t, microbatches) if isinstance(t, torch.Tensor) and t.dim() > 0 else None
             for t in leaves]
    return [pytree.tree_unflatten([p[i] if p is not None else leaf for p, leaf in zip(parts, leaves)], spec)
            for i in range(microbatches)]


def batch_size(inputs: Any) -> int | None:
    first = next((t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    return int(first.shape[0]) if first is not None else None


def to_device(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v, value)


class Buffer(Protocol):
    """Where batches read from an iterable are kept for a restart to replay (``runtime/disk/snapshots.BatchBuffer``)."""

    def get(self, iteration: int) -> Any | None: ...

    def put(self, iteration: int, item: Any) -> None: ...


class Source:
    """Batch ``i`` of the run: ``data(i)`` for a callable, else the next item of an iterable (epochs restart it).

    An iterable is read in order, so resuming at iteration ``i`` skips the first ``i`` batches (across epochs): the
    run continues from the batch it would have read next, given a DataLoader whose order is seeded. With a
    ``buffer`` (a job that restarts failed workers), every batch read is kept there, and a batch found there is
    read from it: a restart replays the very batches the lost iterations read, whatever the iterable.
    """

    def __init__(self, data: Any, start: int, buffer: Buffer | None = None) -> None:
        self.data = data
        self.callable = callable(data) and not hasattr(data, "__iter__")
        self.buffer = buffer
        self._it: Iterator[Any] | None = None
        self._next = start
        self._pos = 0  # batches pulled from the iterable since it began (across epochs): where it stands
        # Batches read ahead (peek) or to be read again: the running iteration's (a dropped iteration runs again with
        # it) and the next one's (whose shapes the boundary checks before the running one is known to be kept).
        self._held: dict[int, tuple[Any, Any]] = {}

    def _pull(self) -> Any:
        for _ in range(2):  # the end of an epoch: start the next one (a DataLoader reshuffles)
            if self._it is None:
                self._it = iter(self.data)
            try:
                item = next(self._it)
                self._pos += 1
                return item
            except StopIteration:
                self._it = None
        raise ValueError(f"the data iterable ({type(self.data).__name__}) yields no batches")

    def peek(self, iteration: int) -> tuple[Any, Any]:
        """Batch ``iteration`` without consuming it (the next ``get`` returns the same batch)."""
        return self.get(iteration)

    def get(self, iteration: int) -> tuple[Any, Any]:
        """Batch ``iteration``; asking again for the same one (a retried iteration) gives the same batch."""
        if iteration in self._held:
            return self._held[iteration]
        batch = self._read(iteration)
        self._held = {i: b for i, b in self._held.items() if i >= iteration - 1}
        self._held[iteration] = batch
        return batch

    def _read(self, iteration: int) -> tuple[Any, Any]:
        if self.callable:
            return _pair(self.data(iteration))
        if iteration != self._next:
            raise ValueError(f"an iterable data source is read in order: asked for batch {iteration}, next is "
                             f"{self._next}")
        item = self.buffer.get(iteration) if self.buffer is not None else None
        if item is None:
            while self._pos < iteration:  # resumed or restarted: another process read the batches before
                self._pull()
            item = self._pull()  # what the iterable raises is what the user sees (the batch is not counted as read)
            if self.buffer is not None:
                self.buffer.put(iteration, item)
        self._next += 1
        return _pair(item)


def _pair(item: Any) -> tuple[Any, Any]:
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    if isinstance(item, dict) and "labels" in item:
        return item, None  # a HuggingFace-style batch: the model takes the labels and returns the loss
    raise TypeError(f"data must give (inputs, targets) pairs, got {type(item).__name__}"
                    + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else ""))


# --- trees across processes: JSON for the structure, tensors for the leaves ------------------------------------------
def describe(tree: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A JSON-able description of ``tree`` (structure, non-tensor leaves, tensor shapes) and its tensors."""
    leaves, spec = pytree.tree_flatten(tree)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    slots = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            slots.append({"shape": list(leaf.shape), "dtype": str(leaf.dtype).removeprefix("torch.")})
        else:
            try:
                json.dumps(leaf)
            except TypeError:
                raise TypeError(f"a {type(leaf).__name__} in the batch cannot cross between stages: only tensors, "
                                "numbers, strings and None can") from None
            slots.append({"value": leaf})
    return {"spec": pytree.treespec_dumps(spec), "slots": slots}, tensors


def rebuild(desc: dict[str, Any], tensors: list[torch.Tensor] | None = None,
            device: torch.device | None = None) -> Any:
    """The tree ``describe`` described, with ``tensors`` in its tensor slots (zeros of the right shapes if None)."""
    spec = pytree.treespec_loads(desc["spec"])
    supply = iter(tensors) if tensors is not None else None
    leaves = []
    for slot in desc["slots"]:
        if "shape" in slot:
            leaves.append(next(supply) if supply is not None else
                          torch.zeros(slot["shape"], dtype=_DTYPES[slot["dtype"]], device=device))
        else:
            leaves.append(slot["value"])
    return pytree.tree_unflatten(leaves, spec)


def described_leaves(desc: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """A ``describe`` description's leaves as ``input_shapes.InputRule`` reads them: ("tensor", dtype, shape) or
    ("value", value, None)."""
    return [("tensor", _DTYPES[slot["dtype"]], tuple(slot["shape"])) if "shape" in slot else ("value", slot["value"], None)
            for slot in desc["slots"]]


def loss_with_check(loss_fn: Callable[[Any, Any], torch.Tensor], finish: Callable[[Any], Any]
                    ) -> Callable[[Any, Any], torch.Tensor]:
    """The user's loss on the model's own output object, insisting on a scalar tensor."""
    def loss(out: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        value = loss_fn(finish(out), target, **kwargs)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"the loss must return a scalar tensor, got {shape}; reduce it (e.g. .mean())")
        return value.reshape(())

    return loss


def signature(inputs: Any, targets: Any) -> str:
    """The shapes and dtypes of a batch, as one string: a change starts a new shape epoch (``runtime/engine/comm.py``)."""
    return json.dumps([describe(inputs)[0], describe(targets)[0]])
