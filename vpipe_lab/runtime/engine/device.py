"""Device and backend choice for a stage, and the timers that put spans on one clock."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    device: torch.device
    backend: str  # "gloo" or "nccl"

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def _gpus_for(local_world: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_world


def pin_cores(device: str, local_rank: int, local_world: int, threads: int) -> list[int] | None:
    """A CPU job's worker keeps to its own ``threads`` cores when this node has that many for every local worker:
    stages then never take each other's core (on 2 cores, a receiver's wake-ups and a Python thread of one stage
    used to preempt the other stage's compute; gpt-tiny on 2 CPU stages ran 0.5-4% faster pinned). Call it before
    any thread starts (threads keep the mask they were born with). The cores it kept to, or None (a GPU job, too
    few cores, or no affinity on this OS): then the OS schedules as usual."""
    if device == "cuda" or (device == "auto" and _gpus_for(local_world)) or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if local_world < 2 or len(allowed) < local_world * threads:
        return None
    mine = allowed[local_rank * threads:(local_rank + 1) * threads]
    os.sched_setaffinity(0, mine)
    log.info("local rank %d keeps to CPU cores %s", local_rank, mine)
    return mine


def select(device: str, local_rank: int, local_world: int, devices: list[int] | None = None) -> Placement:
    """``auto``: one GPU per stage when this node has enough (NCCL), else CPU (gloo); ``cpu`` / ``cuda`` force it.
    ``devices`` names each local rank's GPU (a job that went on without a lost one skips its index)."""
    if device == "cpu":
        return Placement(torch.device("cpu"), "gloo")
    if device == "cuda" or (device == "auto" and _gpus_for(local_world)):
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu' or 'auto'")
        index = devices[local_rank] if devices else local_rank % torch.cuda.device_count()
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


class Stopwatch:
    """Span times of one iteration on the controller's clock, without stalling a GPU between actions.

    On CPU a mark is the clock's time. On CUDA a mark records an event on the compute stream (events are pooled and
    re-recorded); the marks become seconds at the iteration's end, from the events' elapsed time since a reference
    event recorded at the iteration's start, where the one synchronisation of the iteration happens. ``exact`` is
    for profiling iterations, which time each layer with the device synchronised.
    """

    def __init__(self, placement: Placement, clock: Clock) -> None:
        self.placement, self.clock = placement, clock
        self.cuda = placement.is_cuda
        self._pool: list[Any] = []
        self._used = 0
        self._wall = 0.0
        self._ref: Any = None

    def begin(self) -> float:
        """Start an iteration; returns its start on the clock."""
        self._used = 0
        if self.cuda:
            torch.cuda.synchronize(self.placement.device)
            self._ref = torch.cuda.Event(enable_timing=True)
            self._ref.record()
        self._wall = self.clock.now()
        return self._wall

    def mark(self) -> float:
        if not self.cuda:
            return self.clock.now()
        if self._used == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._used]
        event.record()
        self._used += 1
        return float(self._used - 1)

    def seconds(self, mark: float) -> float:
        """A mark as seconds on the clock (on CUDA only after ``end``)."""
        if not self.cuda:
            return mark
        return self._wall + float(self._ref.elapsed_time(self._pool[int(mark)])) / 1e3

    def end(self) -> float:
        """Close the iteration (on CUDA: wait for its last event); returns its end on the clock."""
        if not self.cuda:
            return self.clock.now()
        last = self.mark()
        self._pool[int(last)].synchronize()
        return self.seconds(last)

    def exact(self) -> float:
        synchronize(self.placement)
        return self.clock.now()
