"""Device and backend choice for a stage, and the timers that put spans on one clock."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    device: torch.device
    backend: str  # "gloo" or "nccl"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def select(device: str, local_rank: int, local_world: int) -> Placement:
    """``auto``: one GPU per stage when this node has enough (NCCL), else CPU (gloo); ``cpu`` / ``cuda`` force it."""
    if device == "cpu":
        return Placement(torch.device("cpu"), "gloo")
    has_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if device == "cuda" or (device == "auto" and has_gpus):
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu' or 'auto'")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return Placement(torch.device("cuda", index), "nccl")
    if device != "auto":
        raise ValueError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda'")
    return Placement(torch.device("cpu"), "gloo")


class Clock:
    """Seconds on the controller's clock: this host's monotonic clock plus an offset measured at start-up."""

    def __init__(self, offset_s: float = 0.0) -> None:
        self.offset_s = offset_s

    def now(self) -> float:
        return time.perf_counter() + self.offset_s


def synchronize(placement: Placement) -> None:
    """Make a span's end real on CUDA, where kernels run asynchronously; a no-op on CPU."""
    if placement.is_cuda:
        torch.cuda.synchronize(placement.device)
