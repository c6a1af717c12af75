"""Taking a plan out of the lab: an export bundle written and read (no torch needed), and run on
torch.distributed.pipelining with ``torch_pipeline`` (imports torch when called). See ``wire/bundle.py`` and
``runtime/torch_pp/pipeline.py``."""

from __future__ import annotations

from typing import Any

from vpipe_lab.core.interop.bundle import Bundle, StageSpec, UnitInfo, make
from vpipe_lab.wire.bundle import read, write

__all__ = ["Bundle", "StageSpec", "UnitInfo", "make", "read", "torch_pipeline", "write"]


def torch_pipeline(*args: Any, **kwargs: Any) -> Any:
    """This rank's stages and torch's schedule for an export bundle (``runtime/torch_pp/pipeline.torch_pipeline``)."""
    from vpipe_lab.runtime.torch_pp.pipeline import torch_pipeline as build

    return build(*args, **kwargs)
