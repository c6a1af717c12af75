"""A stage's optimizer step as one training step of the whole model: tied gradients summed, fp16 gradients unscaled,
clipping by the global 2-norm, the step (or the same skipped step on every stage), the LR scheduler.

With data-parallel replicas each stage first averages its gradients over its replicas (``runtime/training/replicas.py``).

``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` on the whole model computes ``sqrt(sum of the squared norms
of every gradient)``: each stage contributes the squares of its own parameters' gradient norms (a weight tied across
stages counts once, on the lowest stage holding it), one all-reduce sums them, and every stage scales its gradients
by the same ``c / (norm + 1e-6)`` clamped to 1. The fp16 overflow flag rides in the same all-reduce, so clipping and
mixed precision cost one collective per iteration; without either there is none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vpipe_lab.core import checks
from vpipe_lab.core.schedules.orders import stashing as pipedream
from vpipe_lab.runtime.engine.allocator import region
from vpipe_lab.runtime.memory.ledger import local_tensor
from vpipe_lab.runtime.training.precision import LossScale
from vpipe_lab.runtime.training.replicas import DataParallel

if TYPE_CHECKING:
    from vpipe_lab.runtime.engine.comm import Peer
    from vpipe_lab.runtime.engine.stage import Stage
    from vpipe_lab.runtime.training.place import Place
    from vpipe_lab.runtime.training.ties import Ties


@dataclass
class StepReport:
    """What one step did, for the metrics: the global gradient norm (before clipping; None when not computed), the
    learning rate it stepped with, the fp16 loss scale it used and whether it was skipped (an fp16 overflow)."""

    grad_norm: float | None = None
    lr: float | None = None
    loss_scale: float | None = None
    skipped: bool = False


class Stepper:
    """Steps one stage in agreement with the others."""

    def __init__(self, stage: Stage, ties: Ties, peer: Peer, place: Place, clip: float | None,
                 scale: LossScale, data_parallel: DataParallel | None = None) -> None:
        checks.positive(clip, "clip_grad_norm", optional=True, what="the largest global gradient 2-norm")
        self.stage, self.ties, self.peer = stage, ties, peer
        self.place = place
        self.clip = None if clip is None else float(clip)
        self.scale = scale
        self.data_parallel = data_parallel
        self.replicas = place.dps  # data-parallel ranks in all
        # a sharded gradient's squares are this rank's shard's, repeated on every replica; a whole one's on every
        # data-parallel rank: each counts once in the sum over the job's ranks (see _step)
        self._sharded_weight = 1.0 / place.replicas
        self._whole_weight = 1.0 / self.replicas

    def _counted(self) -> list[torch.Tensor]:
        """This stage's gradients that count towards the global norm: a tie only on its lowest holder."""
        elsewhere = {name for name, ranks in self.ties.shared if self.place.stage in ranks and min(ranks) != self.place.stage}
        return [p.grad for name, p in self.stage.params() if p.grad is not None and name not in elsewhere]

    def step(self, iteration: int, skip: bool = False) -> StepReport:
        """The step of ``iteration``, or (``skip``: every rank agreed a loss was not finite) its gradients dropped
        and only the LR scheduler stepped, as after an fp16 overflow."""
        with region("step"):  # the optimizer's scratch, where the allocator is measured (engine/allocator.py)
            return self._step(iteration, skip)

    def _step(self, iteration: int, skip: bool = False) -> StepReport:
        stage = self.stage
        if stage.stash.on:  # PipeDream stepped after every micro-batch
            # launch(), apply() and a torchrun job's --schedule refuse what needs one step of the whole model; a
            # torchrun job whose --plan file names PipeDream is checked here
            problem = pipedream.refusal(self.clip, "fp16" if self.scale.enabled else "fp32", self.replicas)
            if problem is not None:
                raise ValueError(problem)
            report = StepReport(lr=stage.optim.step(iteration, skip=True))
            stage.zero_grad()
            return report
        if skip:  # every rank takes this branch (agreed at the boundary), so no collective is left half-done
            report = StepReport(loss_scale=self.scale.scale if self.scale.enabled else None, skipped=True,
                                lr=stage.optim.step(iteration, skip=True))  # the optimizer itself does not step
            stage.zero_grad()
            self.scale.update(True)  # under fp16 a non-finite loss is most likely an overflow: back off
            return report
        if self.data_parallel is not None:  # the replicas' gradients, averaged: one model over the global batch
            self.data_parallel.average([p.grad for _, p in stage.params() if p.grad is not None])
        self.ties.reduce_grads()
        report = StepReport(loss_scale=self.scale.scale if self.scale.enabled else None)
        # a sharded stage's gradients are DTensors: each rank scales, clips and checks its own shard
        grads = [local_tensor(p.grad) for _, p in stage.params() if p.grad is not None]
        overflow = self.scale.unscale(grads)
        if self.clip is not None or overflow is not None or self.scale.enabled:
            squares = 0.0
            if self.clip is not None:
                counted = self._counted()
                for weight, part in ((self._sharded_weight, [local_tensor(g) for g in counted if local_tensor(g) is not g]),
                                     (self._whole_weight, [g for g in counted if local_tensor(g) is g])):
                    if part:
                        norms = torch._foreach_norm(part, 2.0)
                        squares += weight * float(torch.stack(norms).float().pow(2).sum())
            local = [float(overflow) if overflow is not None else 0.0, squares]
            bad, total = self.peer.all_sum(local) if self.place.stages * self.replicas > 1 else local
            report.skipped = bad > 0
            if self.clip is not None:
                report.grad_norm = math.sqrt(total) if not report.skipped else float("inf")
        if report.skipped:
            stage.zero_grad()
        elif self.clip is not None and report.grad_norm is not None and grads:
            coef = min(self.clip / (report.grad_norm + 1e-6), 1.0)
            torch._foreach_mul_(grads, coef)
        report.lr = stage.optim.step(iteration, skip=report.skipped)
        stage.zero_grad()
        self.scale.update(report.skipped)
        return report
