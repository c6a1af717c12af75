"""The paper's PipeDream: 1F1B's order whose stages update after every micro-batch's backward, each backward with the
weights its forward used (weight stashing, ``core/schedules/orders/stashing.py``): other training semantics than the rest."""

from __future__ import annotations

from vpipe_lab.core.schedules.one_f_one_b import OneFOneB
from vpipe_lab.core.schedules.orders import stashing as pipedream


class PipeDream(OneFOneB):
    name = "pipedream"
    megatron = ""
    summary = "1F1B with an update after every micro-batch and stashed weight versions (asynchronous)"
    asynchronous = True
    torch = None
    export_refusal = ("PipeDream updates the weights after every micro-batch with stashed weight versions; "
                      "torch.distributed.pipelining's schedules step once per iteration. Replan with "
                      "method='pipedream-flush' (its synchronous schedule, 1F1B) before exporting")

    def training_refusal(self, clip_grad_norm: float | None, precision: str, replicas: int) -> str | None:
        return pipedream.refusal(clip_grad_norm, precision, replicas)

    def stashed_versions(self, stages: int, stage: int, microbatches: int) -> int:
        return pipedream.stashed_versions(stages, stage, microbatches)

    def weight_copies(self, stages: int, stage: int, microbatches: int) -> int:
        return pipedream.copies(stages, stage, microbatches)
