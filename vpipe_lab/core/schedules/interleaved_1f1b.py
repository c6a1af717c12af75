"""Interleaved 1F1B (Megatron-LM's): ``virtual`` chunks per stage in looped placement (``orders/interleaved.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from vpipe_lab.core.schedules import pipeline_time
from vpipe_lab.core.schedules.actions import Op
from vpipe_lab.core.schedules.kind import ScheduleKind, Step, TorchSchedule
from vpipe_lab.core.schedules.orders import interleaved
from vpipe_lab.core.schedules.plan_view import PlanView as Plan


class Interleaved1F1B(ScheduleKind):
    name = "interleaved-1f1b"
    megatron = "interleaved"  # what --num-layers-per-virtual-pipeline-stage (or a layout's extra stages) runs
    summary = "V chunks per stage, looped: the bubble shrinks V-fold for more transfers"
    chunked = True
    torch = TorchSchedule("Interleaved1F1B", "loop", lambda k, v, m: m % k == 0,
                          "the same order (Megatron-LM's) whenever micro-batches are a multiple of stages")

    def orders(self, stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> list[list[Step]]:
        return [[(Op(op), c, mb) for op, c, mb in order] for order in interleaved.orders(stages, virtual, microbatches)]

    def check(self, stages: int, microbatches: int) -> str | None:
        if microbatches % stages:
            return (f"interleaved-1f1b runs micro-batches in groups of the {stages} stages: microbatches="
                    f"{microbatches} must be a multiple of {stages}")
        return None

    def auto_virtuals(self, stages: int, layers: int, microbatches: int | None) -> tuple[int, ...]:
        if microbatches is None or microbatches % stages:
            return ()
        return tuple(v for v in (2, 3, 4) if stages * v <= layers)

    def inflight(self, stages: int, chunk: int, microbatches: int, virtual: int) -> int:
        """Chunk-forwards held at once on the chunk's stage."""
        return interleaved.peak_inflight(stages, virtual, microbatches, chunk % stages)

    def held(self, stages: int, virtual: int, microbatches: int, rank: int) -> tuple[tuple[int, ...], ...]:
        return interleaved.held(stages, virtual, microbatches, rank)

    def chunks_iteration_time(self, chunk_s: Sequence[float], wgrad_s: Sequence[float], stages: int,
                              microbatches: int, latency_s: float = 0.0) -> float:
        return pipeline_time.chunks_iteration_time(chunk_s, wgrad_s, self.placement(stages, len(chunk_s)), stages,
                                                   microbatches, latency_s, zbv=False)
