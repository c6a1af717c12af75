"""What a stage holds, measured from its real tensors: parameters, gradients, optimizer state and activations."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: its shard when ``t`` is a DTensor (a sharded stage's parameter, gradient or
    optimizer state: ``runtime/engine/shards.py``), else ``t``. Bytes, storages and copies are of this."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None and hasattr(t, "placements") else t  # type: ignore[no-any-return]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's own elements on this rank (not of a larger storage it may view; a DTensor's shard)."""
    t = local_tensor(t)
    return t.numel() * t.element_size()


def module_param_bytes(module: torch.nn.Module) -> int:
    return sum(tensor_bytes(p) for p in module.parameters())


def module_grad_bytes(module: torch.nn.Module) -> int:
    return sum(tensor_bytes(p.grad) for p in module.parameters() if p.grad is not None)


def unit_static_bytes(state: dict[str, Any]) -> int:
    """What one layer adds to a stage's static memory where it goes, from its ``Stage.unit_state``: its tensors, their
    gradients (as large) and its optimizer state (what migration checks against the receiver's budget)."""
    return (2 * sum(tensor_bytes(t) for t in state["tensors"].values())
            + sum(tensor_bytes(v) for st in state["optimizer"].values() for v in st.values()
                  if isinstance(v, torch.Tensor)))


def optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += tensor_bytes(value)
    return total


@dataclass
class Ledger:
    """Activation bytes per (micro-batch, layer), resident on the device or moved to the host store.

    Counted per layer by distinct storage, parameters excluded: the same quantity the profiler reports as a layer's
    ``activation_bytes``, so measured and predicted residency compare like for like.
    """

    device: dict[tuple[int, int], int] = field(default_factory=dict)
    host: dict[tuple[int, int], int] = field(default_factory=dict)
    current: int = 0
    peak: int = 0
    host_current: int = 0
    host_peak: int = 0
    # Peak before the iteration's first backward: what in-flight micro-batches hold between forward and backward,
    # which is what the cost model predicts (working sets of recompute and backward come on top).
    resident_peak: int = 0
    in_backward: bool = False

    def add(self, mb: int, layer: int, nbytes: int) -> None:
        key = (mb, layer)
        self.device[key] = self.device.get(key, 0) + nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        if not self.in_backward:
            self.resident_peak = max(self.resident_peak, self.current)

    def to_host(self, mb: int, layer: int, nbytes: int) -> None:
        key = (mb, layer)
        self.device[key] = self.device.get(key, 0) - nbytes
        self.current -= nbytes
        self.host[key] = self.host.get(key, 0) + nbytes
        self.host_current += nbytes
        self.host_peak = max(self.host_peak, self.host_current)

    def to_device(self, mb: int, layer: int, nbytes: int) -> None:
        key = (mb, layer)
        self.host[key] = self.host.get(key, 0) - nbytes
        self.host_current -= nbytes
        self.add(mb, layer, nbytes)

    def release(self, mb: int, layer: int) -> None:
        key = (mb, layer)
        self.current -= self.device.pop(key, 0)
        self.host_current -= self.host.pop(key, 0)

    def reset_peaks(self) -> None:
        self.peak = self.resident_peak = self.current
        self.host_peak = self.host_current
        self.in_backward = False

    def by_layer_peak(self, layers: Iterable[int]) -> dict[int, int]:
        """Current device bytes per layer, summed over micro-batches."""
        wanted = set(layers)
        out: dict[int, int] = {}
        for (_, layer), n in self.device.items():
            if layer in wanted:
                out[layer] = out.get(layer, 0) + n
        return out
