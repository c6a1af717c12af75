"""A model laid out on the meta device, captured as if it sat on the device its stage runs on.

Workers build the model on the meta device (no memory) and capture it there. But model code branches on the device it
sees: transformers' mixture-of-experts layers count tokens per expert with ``torch.histc`` on floats on CPU and on
ints on CUDA, and pick a grouped-GEMM kernel by device and capability. A graph traced on meta tensors holds the
branch of no real device (``"meta"`` is neither "cpu" nor "mps", so the CUDA branch), and the stage then fails on its
own device (``"histogram_cpu" not implemented for 'Int'``). While the capture runs, every meta parameter and buffer
is a fake tensor (shapes and dtype, still no memory) that reports the run device, so the code takes the run device's
branch; afterwards the model and the graph hold the very meta objects they held before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

__all__ = ["holds_meta", "inputs_on", "restore", "seen_on"]


def holds_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is a meta tensor (a layout without values)."""
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def inputs_on(example: Any, device: torch.device) -> Any:
    """``example`` with its meta tensors as zeros on ``device`` (one micro-batch: small)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                                if t.is_meta else t, example)


@contextmanager
def seen_on(model: nn.Module, device: torch.device) -> Iterator[dict[int, torch.Tensor]]:
    """Inside, each meta parameter and buffer of ``model`` is a fake tensor on ``device``; yields fake id -> the
    meta tensor it stands for (``restore`` puts those back into a module that captured them, e.g. an exported
    graph). On exit the model holds its own meta tensors again, ties included."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}  # id(meta) -> its fake: a tied tensor gets one fake
    originals: dict[int, torch.Tensor] = {}  # id(fake) -> meta
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, value in list(store.items()):
                if value is None or not value.is_meta:
                    continue
                fake = made.get(id(value))
                if fake is None:
                    fake = mode.fake_tensor_converter.from_meta_and_device(mode, value, device)
                    if isinstance(value, nn.Parameter):
                        fake = nn.Parameter(fake, requires_grad=value.requires_grad)
                    made[id(value)], originals[id(fake)] = fake, value
                swapped.append((store, name, value))
                store[name] = fake
    try:
        yield originals
    finally:
        for store, name, value in swapped:
            store[name] = value


def restore(module: nn.Module, originals: dict[int, torch.Tensor]) -> None:
    """Put back, in ``module`` and its submodules, the meta tensors that ``seen_on`` swapped for fakes."""
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for name, value in list(store.items()):
                if value is not None and id(value) in originals:
                    store[name] = originals[id(value)]  # type: ignore[assignment]
