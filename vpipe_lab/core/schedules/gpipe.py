"""GPipe with a flush: every forward of the iteration, then every backward, in micro-batch order."""

from __future__ import annotations

from collections.abc import Sequence

from vpipe_lab.core.schedules import pipeline_time
from vpipe_lab.core.schedules.actions import Op
from vpipe_lab.core.schedules.kind import GPIPE_SHAPED, ScheduleKind, Step, TorchSchedule
from vpipe_lab.core.schedules.plan_view import PlanView as Plan


class GPipe(ScheduleKind):
    name = "gpipe"
    summary = "every forward, then every backward (each stage holds all M micro-batches)"
    flush = GPIPE_SHAPED
    torch = TorchSchedule("GPipe", "loop", lambda k, v, m: True, "the same order")

    def orders(self, stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> list[list[Step]]:
        return [[(Op.F, s, m) for m in range(microbatches)] + [(Op.B, s, m) for m in range(microbatches)]
                for s in range(stages)]

    def inflight(self, stages: int, chunk: int, microbatches: int, virtual: int) -> int:
        return microbatches

    def iteration_time(self, forward: Sequence[float], backward: Sequence[float], microbatches: int,
                       wgrad: Sequence[float] = (), latency_s: float = 0.0, inflight: Sequence[int] = ()) -> float:
        return pipeline_time.gpipe_time(forward, backward, microbatches, latency_s)
