"""The one format tensors cross the control channel in, both directions: raw bytes plus a ``TensorMeta`` each.

Neither side pickles. The worker (which has torch) encodes, the controller decodes only when a caller asks for
tensors (``Session.state_dict()``); that caller has torch, so torch is imported here on request only and the wire
layer stays importable without it.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vpipe_lab.wire.codec import Body


@dataclass
class TensorMeta(Body):
    """One tensor: its canonical ``key``, dtype name (``float32``), shape, and each name ``model.state_dict()`` gives
    it with that name's place there (``aliases``: a tied weight has several)."""

    key: str
    dtype: str
    shape: list[int]
    aliases: list[tuple[str, int]] = field(default_factory=list)


def encode(key: str, tensor: Any) -> tuple[TensorMeta, bytes]:
    """A tensor (any device) as its metadata and raw bytes."""
    torch = importlib.import_module("torch")  # the caller holds a tensor, so torch is loaded already
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    return TensorMeta(key, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)), raw.numpy().tobytes()


def decode(meta: list[TensorMeta], buffers: list[bytes]) -> OrderedDict[str, Any]:
    """The tensors back, by key (CPU, owning their memory)."""
    torch = importlib.import_module("torch")  # only on request: see the module docstring
    out: OrderedDict[str, Any] = OrderedDict()
    for m, raw in zip(meta, buffers):
        dtype = getattr(torch, m.dtype)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        t = data.to(torch.bool) if dtype == torch.bool else data.view(dtype)
        out[m.key] = t.reshape(m.shape).clone()
    return out
