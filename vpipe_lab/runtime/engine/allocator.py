"""What the allocator really held at its most over an iteration and its optimizer step, measured apart from the cost
model's counts.

The memory a stage reports (``Executor.memory``) is its static tensors plus the saved activations the ledger counts:
the very quantities the profile feeds the planner, so it agrees with the prediction by construction and cannot show a
temporary, a workspace, an optimizer step's scratch or anything the count misses. This meter reads the allocator
instead. On CUDA: ``torch.cuda.max_memory_allocated`` (every iteration; it costs nothing). On CPU, whose allocator
keeps no statistics: torch.profiler's memory events (every allocation and free through torch's CPU allocator) over a
measured iteration, whose running sum peaks at what the iteration added at its most, on top of what the stage held when
it began (its parameters, gradients, optimizer state and buffers, read off the tensors). The profiler slows the
iterations it watches, so on CPU one in ``every`` is measured (and the first after start-up); their figure is carried
until the next.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)
EVERY = 25  # CPU: measure one iteration in this many (and iteration 1, once the allocator is warm)


def held(stage: Any) -> int:
    """The bytes a ``Stage``'s own tensors hold now: parameters, gradients, optimizer state and its layers' buffers
    (each tensor once)."""
    seen: set[int] = set()
    total = sum(stage.static_bytes().values())
    for index in stage.owned:
        for b in stage.layers[index].module.buffers():
            if id(b) not in seen and not b.is_meta:
                seen.add(id(b))
                total += b.numel() * b.element_size()
    return total


def peak_of(events: Any) -> int:
    """The highest running sum of memory events' byte counts (allocations positive, frees negative), in time order."""
    deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    total = peak = 0
    for _, nbytes in deltas:
        total += nbytes
        peak = max(peak, total)
    return peak


class PeakMeter:
    """``start`` before an iteration, ``stop`` after its step: the bytes allocated at the peak, or None when this
    iteration was not measured."""

    def __init__(self, device: torch.device, every: int = EVERY) -> None:
        self.device, self.every = device, every
        self._profiler: Any = None
        self._base = 0
        self.last: int | None = None  # the newest measurement
        self.measured_at: int | None = None  # the iteration it was measured in

    def due(self, iteration: int) -> bool:
        return self.device.type == "cuda" or iteration == 1 or (self.every > 0 and iteration % self.every == 0)

    def start(self, iteration: int, held: int) -> None:
        """``held``: the bytes of the stage's tensors now (CPU: the base the profiled allocations add to)."""
        self.stop(discard=True)
        if not self.due(iteration):
            return
        self._iteration = iteration
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._profiler = "cuda"
            return
        try:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            profiler.__enter__()
        except Exception as exc:  # another profiler is running (a user's own): not measured this time
            log.info("the allocator's peak is not measured in iteration %d: %s", iteration, exc)
            return
        self._profiler, self._base = profiler, held

    def stop(self, discard: bool = False) -> int | None:
        """End a measurement; its peak (also kept in ``last``), None if none was running or ``discard``."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return None
        if profiler == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            profiler.__exit__(None, None, None)
            if discard:
                return None
            peak = self._base + peak_of(profiler.profiler.kineto_results.events())
        if discard:
            return None
        self.last, self.measured_at = peak, self._iteration
        return peak

    def report(self) -> dict[str, Any]:
        """The newest measurement for the memory report: ``allocated_peak`` and the iteration it was measured in."""
        return {} if self.last is None else {"allocated_peak": self.last, "allocated_at": self.measured_at}
