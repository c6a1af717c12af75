"""1F1B with a flush (PipeDream-Flush), and its eager variant with one more warm-up forward per stage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from vpipe_lab.core.schedules import pipeline_time
from vpipe_lab.core.schedules.actions import one_f_one_b_order
from vpipe_lab.core.schedules.kind import ScheduleKind, Step, TorchSchedule
from vpipe_lab.core.schedules.plan_view import PlanView as Plan


class OneFOneB(ScheduleKind):
    """K - s - 1 warm-up forwards on stage s, then one forward and one backward alternately, then the drain."""

    name = "1f1b"
    megatron = "1f1b"  # Megatron-LM's default pipeline schedule, without virtual stages
    summary = "K-s-1 warm-up forwards, then alternate (stage s holds K-s micro-batches)"
    torch: ClassVar[TorchSchedule | None] = TorchSchedule(
        "1F1B", "loop", lambda k, v, m: m >= k, "the same order; torch's 1F1B refuses fewer micro-batches than stages")
    eager = False

    def warmup(self, stages: int, stage: int, microbatches: int) -> int:
        return min(stages - stage - 1 + (1 if self.eager and stage < stages - 1 else 0), microbatches)

    def orders(self, stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> list[list[Step]]:
        return [[(op, s, m) for op, m in one_f_one_b_order(self.warmup(stages, s, microbatches), microbatches)]
                for s in range(stages)]

    def inflight(self, stages: int, chunk: int, microbatches: int, virtual: int) -> int:
        return min(microbatches, self.warmup(stages, chunk, microbatches) + 1)

    def iteration_time(self, forward: Sequence[float], backward: Sequence[float], microbatches: int,
                       wgrad: Sequence[float] = (), latency_s: float = 0.0, inflight: Sequence[int] = ()) -> float:
        return pipeline_time.one_f_one_b_time(forward, backward, microbatches, latency_s, inflight)


class EagerOneFOneB(OneFOneB):
    """1F1B with one more warm-up forward on every stage but the last: in the steady state a stage's next input and
    its next gradient arrive while it computes, instead of one transfer latency each way per micro-batch on the
    critical path (for one more micro-batch of activations on those stages)."""

    name = "eager-1f1b"
    megatron = ""
    summary = "1F1B with one more warm-up forward per stage: transfer latency off the critical path"
    torch = TorchSchedule("1F1B", "loop", lambda k, v, m: False,
                          "one more warm-up forward per stage than torch's 1F1B: the CSV runs it")
    eager = True
