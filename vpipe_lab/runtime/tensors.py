"""Tensors as raw bytes plus JSON metadata, to cross the control channel without pickle."""

from __future__ import annotations

from typing import Any

import torch

from vpipe_lab.runtime.stage import Stage


def tensor_to_wire(key: str, t: torch.Tensor) -> tuple[dict[str, Any], bytes]:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    return {"key": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}, raw.numpy().tobytes()


def pack_state(stage: Stage, optimizer: bool = False) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The stage's slice of the model's state_dict, keyed as the whole nn.Sequential would key it."""
    meta, buffers = [], []
    for index in stage.owned:
        layer = stage.layers[index]
        for name, t in layer.module.state_dict().items():
            m, b = tensor_to_wire(f"{index}.{name}", t)
            meta.append(m)
            buffers.append(b)
    return meta, buffers
