"""Tensors as raw bytes plus JSON metadata, to cross the control channel without pickle."""

from __future__ import annotations

from typing import Any

import torch

from vpipe_lab.runtime.stage import Stage


def tensor_to_wire(key: str, t: torch.Tensor) -> tuple[dict[str, Any], bytes]:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    return {"key": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}, raw.numpy().tobytes()


def pack_state(stage: Stage) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The stage's parameters and buffers by their names in the whole model (a tied weight under its first name),
    in layer order."""
    meta, buffers = [], []
    seen: set[str] = set()
    for index in stage.owned:
        for name in stage.layers[index].names:
            if name in seen:
                continue
            seen.add(name)
            m, b = tensor_to_wire(name, stage.tensors[name])
            meta.append(m)
            buffers.append(b)
    return meta, buffers
