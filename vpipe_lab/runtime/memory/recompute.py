"""Explicit activation recompute: forward without saving, rematerialise the layer's graph right before its backward.

This is what ``torch.utils.checkpoint`` does, made explicit so the schedule's RECOMPUTE step is a real, timed step
the executor places (and the timeline shows) instead of happening somewhere inside the backward. RNG state is
captured before the first forward and restored for the second, so dropout draws the same mask and results match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


def leafify(value: Any, grad: bool = True) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """The same structure (a tensor, tuple, dict, ...) with floating tensors replaced by fresh leaves that require
    grad (unless ``grad`` is False: data at the pipeline's start); also returns those leaves in pytree order."""
    if isinstance(value, torch.Tensor):  # the common case, without pytree's per-call cost on the hot path
        leaf = value.detach().requires_grad_(grad and value.is_floating_point())
        return leaf, (leaf,) if leaf.requires_grad else ()
    leaves: list[torch.Tensor] = []

    def fresh(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        leaf = v.detach().requires_grad_(grad and v.is_floating_point())
        if leaf.requires_grad:
            leaves.append(leaf)
        return leaf

    return pytree.tree_map(fresh, value), tuple(leaves)


def copied(value: Any) -> Any:
    """The same structure with every tensor that requires grad cloned (a differentiable copy a layer may change)."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.requires_grad else value
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad else v, value)


def detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, value)


@dataclass
class Saved:
    """What a recomputed layer keeps between forward and backward: its input and the RNG state before it ran."""

    inputs: Any
    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    device: torch.device
    grad: bool = True


def forward_without_saving(layer: Callable[[Any], Any], x: Any, device: torch.device, grad: bool = True
                           ) -> tuple[Any, Saved]:
    """Run ``layer`` (a module, or a segment of them as one callable) without autograd, keeping only its input."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    with torch.no_grad():
        out = layer(x)
    return out, Saved(detach(x), cpu_rng, cuda_rng, device, grad)


def rematerialise(layer: Callable[[Any], Any], saved: Saved, buffers: Iterable[torch.Tensor] = ()
                  ) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Run the layer (or segment) again with autograd on fresh leaves of its saved input; returns (leaves, output).

    ``buffers`` the forward updates in place (BatchNorm's running statistics) are put back afterwards: the first
    forward already counted this micro-batch, as plain training does once."""
    x, leaves = leafify(saved.inputs, saved.grad)
    saved_buffers = [(b, b.clone()) for b in buffers]
    devices = [saved.device] if saved.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=saved.device.type if devices else "cuda"):
        torch.set_rng_state(saved.cpu_rng)
        if saved.cuda_rng is not None:
            torch.cuda.set_rng_state(saved.cuda_rng, saved.device)
        with torch.enable_grad():
            out = layer(x)
    with torch.no_grad():
        for buffer, before in saved_buffers:
            buffer.copy_(before)
    return leaves, out
