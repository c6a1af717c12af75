"""How a worker ends an iteration (``IterationEnd``, a collaborator of ``runtime/worker.py``'s ``Worker``): the
optimizer step (or the iteration dropped on every rank), the report to the controller, and the pauses with nothing
changed: a bad batch before it runs, a stage over its memory budget, and a NaN or infinite loss.

A non-finite loss is found on the stage that computes the loss; under ``nonfinite="pause"`` (the default) or
``"skip"`` every rank learns it in the boundary's all-reduce before any stage steps (so no stage steps early, as it
does under ``"continue"`` without memory budgets): "pause" drops the iteration everywhere and pauses, the loss stage
naming the iteration and micro-batch; "skip" counts the iteration without its optimizer step (the LR scheduler
still steps, as after an fp16 overflow). PipeDream updates during the iteration: its iteration counts either way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.timeline import KINDS
from vpipe_lab.runtime.engine.allocator import PeakMeter
from vpipe_lab.runtime.engine.iteration import IterationResult
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.model import experts
from vpipe_lab.runtime.model.data_checks import BadBatch
from vpipe_lab.runtime.progress import Control
from vpipe_lab.runtime.shape_epochs import ShapeEpochs
from vpipe_lab.runtime.training.step import Stepper, StepReport
from vpipe_lab.runtime.worker_commands import Replies
from vpipe_lab.wire import events as E
from vpipe_lab.wire.jobspec import JobSpec

log = logging.getLogger("vpipe_lab.worker")


def first_nonfinite(losses: Sequence[float]) -> tuple[int, str]:
    """The first micro-batch whose loss is NaN or infinite and how ("nan", "inf", "-inf"); (-1, "") when none."""
    for mb, value in enumerate(losses):
        if not math.isfinite(value):
            return mb, str(value)
    return -1, ""


def unattended_stop(iteration: int, microbatch: int, losses: Sequence[float]) -> FloatingPointError:
    """Why an unattended job (nobody to resume it) stops on a non-finite loss under "pause"; ``losses`` are this
    rank's (the value is named where this rank computed it)."""
    mb, value = first_nonfinite(losses)
    return FloatingPointError(f"the loss of iteration {iteration}, micro-batch {microbatch} is not finite"
                              f"{f' ({value})' if mb >= 0 else ''}: the unattended job stops; --nonfinite skip skips "
                              "such steps")


class EndHost(Protocol):
    """What ``IterationEnd`` reads of its ``Worker``: the job, this rank, its stage and optimizer step, and the plan
    in force (replaced by a change, so read when asked)."""

    spec: JobSpec
    index: int
    global_rank: int
    replica: int
    leader: bool
    ctl: Control
    stage: Stage
    stepper: Stepper
    shapes: ShapeEpochs
    samples: int | None
    meter: PeakMeter
    plan: Plan

    replies: Replies  # acknowledgements and the job as it is now (rank 0's to send)

    def send(self, body: Any) -> None:
        """Send ``body`` to the controller."""


class IterationEnd:
    """The end of an iteration on one rank of a ``Worker`` (its ``host``)."""

    def __init__(self, host: EndHost) -> None:
        self.host = host

    def steps_early(self) -> bool:
        """Whether each stage steps as soon as its own backward is done (the last stage while the first still runs
        its last backward), as plain pipelines do: only when no rank can veto the step at the boundary (no memory
        budget, and non-finite losses trained on)."""
        h = self.host
        return h.spec.settings.memory_budget is None and h.spec.settings.nonfinite == "continue"

    def loss_verdict(self, result: IterationResult) -> int:
        """This rank's word for the boundary's all-reduce: 1 + the first micro-batch whose loss is not finite, 0 when
        every loss is (or the job trains on whatever the loss)."""
        h = self.host
        mb, value = first_nonfinite(result.losses)
        if mb < 0:
            return 0
        log.warning("the loss of iteration %d, micro-batch %d is %s", result.iteration, mb, value)
        return 0 if h.spec.settings.nonfinite == "continue" else mb + 1

    def refuse_batch(self, exc: BadBatch) -> None:
        """Every rank: the coming batch is bad data. Pause with nothing changed (the controller raises DataError);
        a resume reads and checks that batch again."""
        h = self.host
        if h.spec.settings.iterations is not None:  # an unattended job has nobody to resume it: it fails with the cause
            raise exc
        h.ctl.paused = True
        h.shapes.start()
        log.error("iteration %d's batch is bad data: %s; paused", h.ctl.iteration, exc)
        if h.leader:
            h.send(E.Failure("data", h.index, h.global_rank, h.replica, h.ctl.iteration, cause=str(exc)))
            h.replies.current()

    def finish(self, result: IterationResult, failed: bool, memory: dict[str, Any], stepped: StepReport | None,
               bad_loss: int = 0) -> bool:
        """Step (unless done already), or drop the iteration on every rank and pause when any rank went over its
        budget or a loss was not finite under "pause" (PipeDream, whose updates are made, takes it and pauses);
        under "skip" a non-finite loss counts the iteration without its step. Whether it was taken without failing.
        ``bad_loss`` is the boundary's agreed 1 + micro-batch of a non-finite loss (0: none)."""
        h = self.host
        # PipeDream's stages updated their weights during the iteration: it cannot be undone, so it counts
        applied = h.stage.stash.on
        pause_loss = bad_loss > 0 and h.spec.settings.nonfinite == "pause"
        if pause_loss and h.spec.settings.iterations is not None:  # an unattended job has nobody to resume it
            raise unattended_stop(result.iteration, bad_loss - 1, result.losses)
        dropped = failed or pause_loss
        if dropped and not applied:
            # No parameter or optimizer state changes; the same iteration runs again after resume.
            h.stage.discard()
            experts.take()  # nor do its experts' counts: they come again with the iteration
        if not dropped or applied:
            if stepped is None:
                stepped = h.stepper.step(result.iteration, skip=bad_loss > 0)
            h.ctl.iteration += 1
            self.report(result, memory, stepped)
        if dropped:
            h.ctl.paused = True
            if result.violation is not None:
                v = result.violation
                h.send(E.Failure("budget", h.index, h.global_rank, h.replica, result.iteration,
                                    used=v.used_bytes, budget=v.budget_bytes, layers=[list(x) for x in v.layers],
                                    memory=memory, taken=applied))
            mb, value = first_nonfinite(result.losses)
            if pause_loss and mb >= 0:  # the stage that computed it names it
                h.send(E.Failure("loss", h.index, h.global_rank, h.replica, result.iteration,
                                    cause=value, microbatch=mb, taken=applied))
        return not dropped

    def report(self, result: IterationResult, memory: dict[str, Any], step: StepReport) -> None:
        h = self.host
        h.meter.stop(h.stage)  # the allocator's peak over the iteration and its step, where measured
        memory = {**memory, **h.meter.report()}
        spans = [(KINDS.index(k), mb, -1 if layer is None else layer, s, e, c) for k, mb, layer, s, e, c in result.spans]
        h.send(E.IterationReport(
            result.iteration, h.index, result.start_s, result.end_s, result.losses, memory, spans,
            h.plan.microbatches, h.ctl.plan_version, h.replica, h.samples, result.sizes,
            step.grad_norm, step.lr, step.loss_scale, step.skipped, result.loss_sum, experts.take() or None))
