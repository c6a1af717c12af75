"""Taking a plan out of the lab: an export bundle written and read (no torch needed), and run on
torch.distributed.pipelining with ``torch_pipeline`` (imports torch when called). See ``wire/bundle_files.py`` and
``runtime/torch_pp/pipeline.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vpipe_lab.core.interop.bundle import Bundle, StageSpec, UnitInfo, make
from vpipe_lab.wire.bundle_files import read, write

if TYPE_CHECKING:  # names for the signature only: importing this module must not import torch
    from vpipe_lab.runtime.torch_pp.pipeline import TorchPipeline

__all__ = ["Bundle", "StageSpec", "UnitInfo", "make", "read", "torch_pipeline", "write"]


def torch_pipeline(model: Any, bundle: str | Path | Bundle, rank: int | None = None, *, example: Any = None,
                   loss_fn: Callable[..., Any] | None = None, device: Any = None, group: Any = None,
                   use_csv: bool = False, trace: bool | None = None, schedule: str | None = None) -> TorchPipeline:
    """Build ``rank``'s part of the bundle (default: this process's rank in ``group``) from ``model`` (an
    ``nn.Module`` built the same way on every rank), ready to train on torch.distributed.pipelining:
    ``pp.step(inputs, target=..., losses=...)`` then the optimizer's step on ``pp.parameters()``. ``example`` is one
    micro-batch of inputs (needed to trace any model but an ``nn.Sequential``); ``loss_fn(output, target)`` is per
    micro-batch, and gradients are of the micro-batches' mean, as the lab trains. ``device`` is where this rank's
    stages run (default: CPU); ``group`` the pipeline's process group. ``trace`` forces torch's ``pipeline()`` split;
    ``use_csv`` runs ``schedule.csv`` even where a torch class runs the same order; ``schedule`` names a torch schedule
    class to run the bundle's split with instead. A sharded bundle's ranks each take their shard (``fully_shard``).
    Imports torch when called (``runtime/torch_pp/pipeline.py``)."""
    from vpipe_lab.runtime.torch_pp.pipeline import torch_pipeline as build

    return build(model, bundle, rank, example=example, loss_fn=loss_fn, device=device, group=group, use_csv=use_csv,
                 trace=trace, schedule=schedule)
