"""ZBV: two chunks per stage in V placement (down the stages and back up), the backward split into B and W
(``core/schedules/orders/v_placement.py``); the last stage hands its first chunk's output to its second without a transfer."""

from __future__ import annotations

from collections.abc import Sequence

from vpipe_lab.core.schedules import pipeline_time
from vpipe_lab.core.schedules.actions import Op
from vpipe_lab.core.schedules.kind import ScheduleKind, Step, TorchSchedule
from vpipe_lab.core.schedules.orders import v_placement
from vpipe_lab.core.schedules.plan_view import PlanView as Plan


class ZBV(ScheduleKind):
    name = "zbv"
    summary = "two chunks per stage in a V, split backward: zero bubble at 1F1B's memory"
    chunked = True
    virtual_choices = (2,)
    split_backward = True
    torch = TorchSchedule("ZBVZeroBubble", "v", lambda k, v, m: m == 1 or m >= 2 * k - 1,
                          "the same order from 2 x stages - 1 micro-batches on (and for 1); with fewer, the two "
                          "orders fill the warm-up differently")

    def placement(self, stages: int, chunks: int) -> tuple[int, ...]:
        if chunks == 2 * stages:
            return tuple(range(stages)) + tuple(reversed(range(stages)))
        return super().placement(stages, chunks)

    def orders(self, stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> list[list[Step]]:
        return [[(Op(op), c, mb) for op, c, mb in order] for order in v_placement.orders(stages, microbatches)]

    def inflight(self, stages: int, chunk: int, microbatches: int, virtual: int) -> int:
        """This chunk's forwards held at once awaiting their B."""
        side = 0 if chunk < stages else 1
        return max(h[side] for h in self.held(stages, virtual, microbatches, self.placement(stages, 2 * stages)[chunk]))

    def held(self, stages: int, virtual: int, microbatches: int, rank: int) -> tuple[tuple[int, ...], ...]:
        return v_placement.held(stages, microbatches, rank)

    def chunks_iteration_time(self, chunk_s: Sequence[float], wgrad_s: Sequence[float], stages: int,
                              microbatches: int, latency_s: float = 0.0) -> float:
        return pipeline_time.chunks_iteration_time(chunk_s, wgrad_s, self.placement(stages, len(chunk_s)), stages,
                                                   microbatches, latency_s, zbv=True)
