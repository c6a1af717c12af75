"""Captured graphs for the shapes the data has. A model is captured once with every input dimension free
(``input_shapes.py``); most new shapes (another batch size, a short last batch, another sequence length or micro-batch
count) fit that graph. Where torch.export had to specialise a dimension, the model is captured again for the new
shapes, on the meta device (no memory, no compute), and each of this stage's units takes the new graph over the very
same parameter and buffer objects, so optimizer state, ties and gradients carry on untouched. Every rank does the
same thing at the same iteration boundary from the same description (rank 0 broadcasts it), so the graphs agree.
Captures are kept per shape signature: alternating lengths capture once each.
"""

from __future__ import annotations

import copy
import json
import logging
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from vpipe_lab.runtime.build import on_meta
from vpipe_lab.runtime.model.batches import described_leaves, rebuild
from vpipe_lab.runtime.model.capture import CaptureError, Chain, SplitSpec, build_model, capture

log = logging.getLogger(__name__)
KEEP = 8  # captures kept (least recently used ones go first)


class Recaptures:
    """The chains this worker captured for other shapes, by the first micro-batch's description."""

    def __init__(self, model: Any, split: SplitSpec, seed: int, device: torch.device | None = None) -> None:
        self.model, self.split, self.seed = model, split, seed  # model: the factory (or instance) of the job
        self.device = device  # the stage's: a meta layout is traced as if there (model/trace/run_device.py)
        self._cache: OrderedDict[str, Chain] = OrderedDict()
        self.captures = 0  # how many times the model was captured again (tests and logs read it)

    def reset(self, model: Any) -> None:
        """Another model now (``set_model``): captures of the old one do not apply."""
        self.model = model
        self._cache.clear()

    def chain_for(self, current: Chain, descriptions: list[dict[str, Any]]) -> Chain | None:
        """None if ``current`` takes every micro-batch ``descriptions`` describes; else a chain that does (its units
        still hold meta tensors: ``bind`` gives them this stage's). Raises CaptureError when no one graph can."""
        if not current.graph or not any(current.problem(described_leaves(d)) for d in descriptions):
            return None
        key = json.dumps(descriptions[0], sort_keys=True)
        chain = self._cache.pop(key, None)
        if chain is None:
            chain = self._capture(current, descriptions[0])
        self._cache[key] = chain
        while len(self._cache) > KEEP:
            self._cache.popitem(last=False)
        problems = [p for d in descriptions if (p := chain.problem(described_leaves(d)))]
        if problems:
            raise CaptureError(f"the model's graph is specialised to its inputs' shapes ({problems[0]}), so micro-"
                               "batches of different sizes cannot share one: give batches that split evenly into the "
                               "micro-batches (drop_last=True in a DataLoader), or pad them to one size")
        return chain

    def _capture(self, current: Chain, description: dict[str, Any]) -> Chain:
        model = meta_model(self.model, self.seed)
        meta = torch.device("meta") if any(t.is_meta for t in model.parameters()) else None
        chain = capture(model.train(), rebuild(description, device=meta), self.split, self.device)
        self.captures += 1
        mine = [[c for _, c in t.params + t.buffers] for t in current.tensors]
        theirs = [[c for _, c in t.params + t.buffers] for t in chain.tensors]
        if chain.names != current.names or mine != theirs:
            raise CaptureError(f"captured for new input shapes, the model is cut into other units ({chain.names}, "
                               f"before {current.names}): give batches of one shape, or split it explicitly")
        chain.aliases, chain.non_persistent, chain.mutated = current.aliases, current.non_persistent, current.mutated
        chain.state_keys = current.state_keys
        log.info("captured the model again for new input shapes (%d captures kept)", len(self._cache) + 1)
        return chain


def meta_model(model: Any, seed: int) -> nn.Module:
    """The model's structure, for a capture: built on the meta device from its factory, or a meta copy of the
    instance the job was given (built for real only when neither works)."""
    if callable(model) and not isinstance(model, nn.Module):
        try:
            return on_meta(model, seed)[0]
        except Exception:  # a factory that needs real tensors: build it (memory for one model, once per shape)
            return build_model(model, seed)
    return copy.deepcopy(model).to("meta")
