"""Runs one iteration of a stage: walks its row of the core schedule IR, timing every action onto a span.

Micro-batches are ``torch.chunk`` of the mini-batch along dim 0; each micro-batch's loss is scaled by 1/M, so the
gradients are those of the mean of the per-micro-batch losses and a pipelined step equals a plain full-batch step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vpipe_lab.core.model import Plan
from vpipe_lab.core.schedule import Op, Schedule, for_plan
from vpipe_lab.runtime import faults
from vpipe_lab.runtime.batches import loss_with_check, split, to_device
from vpipe_lab.runtime.capture import Chain
from vpipe_lab.runtime.comm import TAG_BACKWARD, TAG_FORWARD, Peer
from vpipe_lab.runtime.device import Clock, Placement, synchronize
from vpipe_lab.runtime.stage import Stage

LossFn = Callable[[Any, Any], torch.Tensor]

_KIND = {
    Op.F: "forward", Op.B: "backward", Op.RECOMPUTE: "recompute", Op.SEND_F: "send", Op.SEND_B: "send",
    Op.RECV_F: "recv", Op.RECV_B: "recv", Op.SWAP_OUT: "swap_out", Op.SWAP_IN: "swap_in",
}


def default_loss(output: Any, target: Any) -> torch.Tensor:
    """The model's own loss when it computed one (HuggingFace models given ``labels``); else cross-entropy over the
    last dimension for integer targets and mean squared error otherwise, on the logits when the output has them."""
    own = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
    if target is None:
        if own is None:
            raise ValueError("the data gave no targets and the model's output has no loss: give (inputs, targets) "
                             "or a loss function")
        return own
    if not isinstance(output, torch.Tensor):
        logits = getattr(output, "logits", None) if not isinstance(output, dict) else output.get("logits")
        output = logits if logits is not None else output[0]
    if isinstance(target, torch.Tensor) and not target.is_floating_point():
        return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return torch.nn.functional.mse_loss(output, target)


@dataclass
class BudgetViolation:
    stage: int
    used_bytes: int
    budget_bytes: int
    layers: list[tuple[int, int]]  # (layer, resident bytes) of kept layers, largest first


@dataclass
class IterationResult:
    iteration: int
    start_s: float
    end_s: float
    losses: list[float] = field(default_factory=list)
    spans: list[tuple[str, int, int | None, float, float]] = field(default_factory=list)
    violation: BudgetViolation | None = None


class Executor:
    """Executes a stage's schedule for each iteration."""

    def __init__(self, rank: int, world: int, stage: Stage, peer: Peer, placement: Placement, clock: Clock,
                 loss_fn: LossFn, budget: int | None = None, record_spans: bool = True,
                 chain: Chain | None = None) -> None:
        self.rank, self.world = rank, world
        self.stage, self.peer, self.placement, self.clock = stage, peer, placement, clock
        self.chain = chain
        self.loss_fn = loss_with_check(loss_fn, chain.finish if chain is not None else (lambda out: out))
        self.budget = budget
        self.record_spans = record_spans
        self._schedule: tuple[Plan, Schedule] | None = None
        self.fault = faults.parse()
        self._static = self._param_bytes = 0

    def schedule(self, plan: Plan) -> Schedule:
        if self._schedule is None or self._schedule[0] != plan:
            self._schedule = (plan, for_plan(plan))
        return self._schedule[1]

    def _timer(self) -> float:
        synchronize(self.placement)
        return self.clock.now()

    def _check_budget(self, result: IterationResult) -> None:
        if self.budget is None or result.violation is not None:
            return
        # Parameters and optimizer state are fixed within an iteration; gradients appear with the first backward
        # and are parameter-sized. Walking every tensor after each layer would put O(parameters) on the hot path.
        static = self._static + (self._param_bytes if self.stage.ledger.in_backward else 0)
        used = static + self.stage.ledger.current
        if used > self.budget:
            per_layer = self.stage.ledger.by_layer_peak(self.stage.owned)
            kept = sorted(((i, b) for i, b in per_layer.items() if self.stage.layers[i].policy.value == "keep"),
                          key=lambda x: -x[1])
            result.violation = BudgetViolation(self.rank, used, self.budget, kept)

    def run(self, iteration: int, plan: Plan, batch: tuple[Any, Any] | None) -> IterationResult:
        rank, last = self.rank, self.rank == self.world - 1
        m = plan.microbatches
        stage = self.stage
        stage.loss_scale = 1.0 / m
        stage.ledger.reset_peaks()
        if self.budget is not None:
            sizes = stage.static_bytes()
            self._param_bytes = sizes["params"]
            self._static = sizes["params"] + sizes["grads"] + sizes["optimizer"]
        inputs = targets = None
        if batch is not None:
            if rank == 0:
                inputs = split(batch[0], m, "inputs")
            if last:
                targets = [None] * m if batch[1] is None else split(batch[1], m, "targets")
        chain = self.chain
        owned = stage.owned
        received: dict[int, Any] = {}
        outputs: dict[int, Any] = {}
        grads_out: dict[int, tuple[torch.Tensor, ...]] = {}
        grads_in: dict[int, tuple[torch.Tensor, ...]] = {}
        now = self._timer
        result = IterationResult(iteration, now(), 0.0)
        for action in self.schedule(plan).stages[rank]:
            op, mb = action.op, action.microbatch
            if op in (Op.RECV_B, Op.RECOMPUTE, Op.B):
                stage.ledger.in_backward = True  # from here on, working sets of the backward phase
            start = now()
            if op is Op.RECV_F:
                got = self.peer.recv(rank - 1, TAG_FORWARD)
                received[mb] = chain.unpack(owned[0] - 1, got) if chain is not None else (got[0] if len(got) == 1
                                                                                            else got)
            elif op is Op.F:
                if self.fault is not None:
                    faults.hit(self.fault, "forward", rank, iteration)
                if rank > 0:
                    x = received.pop(mb)
                else:
                    x = to_device(inputs[mb], self.placement.device)  # type: ignore[index]
                    x = chain.start(x) if chain is not None else x
                for index in owned:
                    x = stage.forward(iteration, mb, index, x, now, input_grad=rank > 0 or index != owned[0])
                    self._check_budget(result)
                if last:
                    target = to_device(targets[mb], self.placement.device)  # type: ignore[index]
                    result.losses.append(stage.attach_loss(mb, owned[-1], x, self.loss_fn, target, now))
                else:
                    outputs[mb] = x
            elif op is Op.SEND_F:
                out = outputs.pop(mb)
                self.peer.send(chain.pack(out) if chain is not None else out, rank + 1, TAG_FORWARD)
            elif op is Op.SWAP_OUT:
                if action.layer in stage.layers:
                    stage.swap.swap_out(mb, action.layer)
            elif op is Op.SWAP_IN:
                if action.layer in stage.layers:
                    stage.swap.swap_in(mb, action.layer)
            elif op is Op.RECV_B:
                grads_out[mb] = self.peer.recv(rank + 1, TAG_BACKWARD)
            elif op is Op.RECOMPUTE:
                if action.layer in stage.layers:
                    stage.rematerialise(mb, action.layer, now)
                    self._check_budget(result)
            elif op is Op.B:
                grads: tuple[torch.Tensor, ...] | None = None if last else grads_out.pop(mb)
                for index in reversed(owned):
                    grads = stage.backward(mb, index, grads, now)
                if rank > 0:
                    grads_in[mb] = grads  # type: ignore[assignment]
            elif op is Op.SEND_B:
                self.peer.send(grads_in.pop(mb), rank - 1, TAG_BACKWARD)
            if self.record_spans:
                result.spans.append((_KIND[op], mb, action.layer, start, now()))
        self.peer.flush()
        result.end_s = now()
        return result

