"""Rebuilding tensors from the workers' raw bytes on the caller's side.

The control layer never needs torch; a caller who asks for tensors (``Session.state_dict()``) has it, so it is
imported here only when that happens.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import Any


def rebuild(meta: list[dict[str, Any]], buffers: list[bytes]) -> OrderedDict[str, Any]:
    torch = importlib.import_module("torch")  # only on request: see the module docstring
    out: OrderedDict[str, Any] = OrderedDict()
    for m, raw in zip(meta, buffers):
        dtype = getattr(torch, m["dtype"])
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        t = data.to(torch.bool) if dtype == torch.bool else data.view(dtype)
        out[m["key"]] = t.reshape(m["shape"]).clone()
    return out
