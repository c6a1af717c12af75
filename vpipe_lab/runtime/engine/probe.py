"""Micro-batch-size probes: a layer timed alone at half and twice the running micro-batch, in profiling iterations.

The points feed each layer's throughput-vs-micro-batch-size curve (``core/cost/scaling.py``), which the planner uses to
choose the micro-batch size. Nothing a probe computes stays: gradients come from ``torch.autograd.grad`` (not
accumulated), buffers (running statistics) are stand-in copies while the probes run, so the real ones are not even
written (a captured graph's batch norm saves them for its backward: writing them would break it), and the next
layer is seeded afresh anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from vpipe_lab.runtime.engine import wgrad
from vpipe_lab.runtime.memory import recompute
from vpipe_lab.runtime.model.units import Layer, tensors_of

log = logging.getLogger(__name__)

Timer = Callable[[], float]
Autocast = Callable[[], AbstractContextManager[object]]


def probe_or_note(layer: Layer, autocast: Autocast, x: Any, timer: Timer, input_grad: bool,
                  unprobed: set[int]) -> None:
    """``probe``, or (a layer that only takes its own batch size: a fixed reshape, say) ``layer`` noted in
    ``unprobed``, its time then taken as linear in the micro-batch size."""
    try:
        probe(layer, autocast, x, timer, input_grad)
    except Exception as exc:
        log.info("layer %d cannot be timed at other micro-batch sizes (%s: %s); its time is taken as linear in the "
                 "micro-batch size", layer.index, type(exc).__name__, exc)
        unprobed.add(layer.index)


def probe(layer: Layer, autocast: Autocast, x: Any, timer: Timer, input_grad: bool = True) -> None:
    """Time ``layer`` alone (in the stage's ``autocast``) on micro-batches of half and twice this one's size, cut from
    or repeated along dim 0 of its real input ``x``; the times go to the layer's stats."""
    module = layer.module
    rows = next((t.shape[0] for t in tensors_of(x) if t.dim() > 0), 0)
    params = [p for p in module.parameters() if p.requires_grad]
    real = [(owner, name, b) for owner in module.modules() for name, b in owner._buffers.items() if b is not None]
    for owner, name, b in real:
        owner._buffers[name] = b.detach().clone()
    try:  # plain autograd: the fused Linear backward would add the probes' gradients to .grad
        for size in (rows // 2, 2 * rows):
            if size >= 1:
                with wgrad.suspended():
                    _probe_at(layer, autocast, x, rows, size, params, timer, input_grad)
    finally:
        for owner, name, b in real:
            owner._buffers[name] = b


def _probe_at(layer: Layer, autocast: Autocast, x: Any, rows: int, size: int, params: list[torch.nn.Parameter],
              timer: Timer, input_grad: bool) -> None:
    resized = pytree.tree_map(lambda v: resize(v, rows, size) if isinstance(v, torch.Tensor) else v, x)
    inp, leaves = recompute.leafify(resized, input_grad)
    start = timer()
    with autocast():
        out = layer.module(inp)
    middle = timer()
    outs = [t for t in tensors_of(out) if t.requires_grad]
    wrt = params + [leaf for leaf in leaves if leaf.requires_grad]
    if outs and wrt:
        torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)
    layer.stats.add_size(size, middle - start, timer() - middle)


def resize(t: torch.Tensor, rows: int, size: int) -> torch.Tensor:
    """``t`` with ``size`` rows instead of ``rows`` along dim 0 (cut, or repeated); other tensors as they are."""
    if t.dim() == 0 or t.shape[0] != rows:
        return t
    if size <= rows:
        return t[:size]
    return t.repeat(-(-size // rows), *([1] * (t.dim() - 1)))[:size]
