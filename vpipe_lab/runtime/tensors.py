"""Tensors as raw bytes plus JSON metadata, to cross the control channel without pickle."""

from __future__ import annotations

from typing import Any

import torch

from vpipe_lab.runtime.capture import Chain
from vpipe_lab.runtime.stage import Stage


def tensor_to_wire(key: str, t: torch.Tensor) -> tuple[dict[str, Any], bytes]:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    return {"key": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}, raw.numpy().tobytes()


def pack_state(stage: Stage, chain: Chain | None = None) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The stage's parameters and buffers, each once, by canonical name in layer order, each with every name
    ``model.state_dict()`` gives it and that name's place there (``aliases``: a tied weight has several); the
    tensors ``model.state_dict()`` leaves out (non-persistent buffers) stay out. Without a chain: canonical names."""
    meta, buffers = [], []
    seen: set[str] = set()
    place = {key: i for i, key in enumerate(chain.state_keys)} if chain is not None else {}
    for index in stage.owned:
        for name in stage.layers[index].names:
            if name in seen or (chain is not None and name in chain.non_persistent):
                continue
            seen.add(name)
            m, b = tensor_to_wire(name, stage.tensors[name])
            names = chain.aliases.get(name, [name]) if chain is not None else [name]
            m["aliases"] = [[alias, place.get(alias, len(place))] for alias in names]
            meta.append(m)
            buffers.append(b)
    return meta, buffers
