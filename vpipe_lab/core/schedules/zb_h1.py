"""Zero-bubble ZB-H1: 1F1B's memory, each backward split into B (input gradient) and W (weights' gradients), the W steps
placed into what would be bubbles (``core/schedules/orders/zero_bubble.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from vpipe_lab.core.policy import Policy
from vpipe_lab.core.schedules import pipeline_time
from vpipe_lab.core.schedules.actions import Op
from vpipe_lab.core.schedules.kind import ScheduleKind, Step, TorchSchedule
from vpipe_lab.core.schedules.orders import zero_bubble
from vpipe_lab.core.schedules.plan_view import PlanView as Plan


class ZBH1(ScheduleKind):
    name = "zb-h1"
    summary = "1F1B's memory with the backward split into B and W, W filling the bubbles"
    split_backward = True
    torch = TorchSchedule("InterleavedZeroBubble", "loop", lambda k, v, m: m in (1, k),
                          "torch's ZB1P holds fewer W steps back on the first stages: the same order only when "
                          "micro-batches = 1 or = stages")

    def orders(self, stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> list[list[Step]]:
        """Worked out with the paper's unit costs (F = B = W), a stage's B longer by the share of its layers it
        recomputes (each is a forward again)."""
        backward = [1.0] * stages
        if plan is not None:
            for s in range(stages):
                layers = plan.layers_of(s)
                backward[s] += sum(plan.policies[i] is Policy.RECOMPUTE for i in layers) / max(1, len(layers))
        return [[(Op(op), s, mb) for op, mb in order]
                for s, order in enumerate(zero_bubble.zb_h1_orders(stages, microbatches, backward=backward))]

    def inflight(self, stages: int, chunk: int, microbatches: int, virtual: int) -> int:
        return min(microbatches, stages - chunk)

    def waiting_w(self, stages: int, stage: int, microbatches: int) -> int:
        return min(microbatches, zero_bubble.waiting_w(stages, stage))

    def iteration_time(self, forward: Sequence[float], backward: Sequence[float], microbatches: int,
                       wgrad: Sequence[float] = (), latency_s: float = 0.0, inflight: Sequence[int] = ()) -> float:
        return pipeline_time.zb_h1_time(forward, backward, microbatches, wgrad, latency_s, inflight)
