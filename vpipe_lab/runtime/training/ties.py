"""Tied parameters across stages: every stage that holds a shared weight keeps a copy, and the copies stay equal.

A weight used by units on several stages (a GPT-style model's embedding, which its LM head reuses) is held by each of
those stages. Before the optimizer step their gradients are summed over exactly those stages (Megatron's "embedding
group" all-reduce), so every copy gets the gradient plain training would give the one weight, and the same optimizer
step on the same state keeps the copies bit-for-bit equal. Within a stage a tie is one tensor (see ``stage.Stage``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from vpipe_lab.core.plan import Plan
    from vpipe_lab.runtime.engine.comm import Peer
    from vpipe_lab.runtime.engine.stage import Stage
    from vpipe_lab.runtime.model.capture import Chain
    from vpipe_lab.runtime.training.place import Place


def holders(plan_layers: list[list[int]], unit_params: list[list[str]]) -> list[tuple[str, tuple[int, ...]]]:
    """(parameter, the stages holding it) for each parameter held by more than one stage, in a fixed order."""
    where: dict[str, set[int]] = {}
    for stage, layers in enumerate(plan_layers):
        for i in layers:
            for name in unit_params[i]:
                where.setdefault(name, set()).add(stage)
    return sorted((name, tuple(sorted(ranks))) for name, ranks in where.items() if len(ranks) > 1)


def conflict(plan_layers: list[list[int]], unit_buffers: list[list[str]], mutated: set[str] | None,
             names: list[str]) -> str | None:
    """Why a plan cannot be honoured, if it cannot: a buffer the forward writes (running statistics) used by units
    on different stages would drift apart, since buffers have no gradient to reduce."""
    for name, ranks in holders(plan_layers, unit_buffers):
        if mutated is None or name in mutated:
            users = [names[i] for s in ranks for i in plan_layers[s] if name in unit_buffers[i]]
            return (f"buffer {name!r} is shared by units {users} on stages {list(ranks)} and updated in forward; a "
                    "shared buffer cannot be kept equal across stages: keep those units on one stage")
    return None


class Ties:
    """The tied parameters of the plan in force and the process groups that reduce their gradients."""

    def __init__(self, peer: Peer, stage: Stage, place: Place, plan: Plan, chain: Chain) -> None:
        self.peer, self.stage, self.place = peer, stage, place
        self._groups: dict[tuple[int, ...], Any] = {}
        self.shared: list[tuple[str, tuple[int, ...]]] = []
        self.chain = chain
        self.refresh(plan, chain)

    def refresh(self, plan: Plan, chain: Chain) -> None:
        """Recompute after a plan change; every rank runs this at the same boundary (group creation is collective)."""
        self.chain = chain
        plan_layers = [list(plan.layers_of(s)) for s in range(self.place.stages)]
        problem = self.conflict(plan)
        if problem is not None:
            raise ValueError(problem)
        self.shared = holders(plan_layers, [[c for _, c in t.params] for t in chain.tensors])
        for ranks in sorted({r for _, r in self.shared}):
            if ranks in self._groups or (len(ranks) == self.place.stages and self.place.dps == 1):
                continue  # the whole (single) pipeline: the default group
            # One group per pipeline replica; every rank creates all of them, in the same order (it is collective).
            for dp in range(self.place.dps):
                group = dist.new_group([self.place.rank_of(r, dp) for r in ranks])
                if dp == self.place.dp:
                    self._groups[ranks] = group

    def conflict(self, plan: Plan, chain: Chain | None = None) -> str | None:
        chain = chain or self.chain
        plan_layers = [list(plan.layers_of(s)) for s in range(self.place.stages)]
        tied = holders(plan_layers, [[c for _, c in t.params] for t in chain.tensors])
        if plan.kind.asynchronous and tied:  # one weight, updated by two stages at their own times
            name, ranks = tied[0]
            return (f"parameter {name!r} is tied across stages {list(ranks)}; under PipeDream each stage updates its "
                    "weights on its own after every micro-batch, so a tie cannot stay one weight: keep the tied layers "
                    "on one stage or use a synchronous schedule ('1f1b')")
        return conflict(plan_layers, [[c for _, c in t.buffers] for t in chain.tensors], chain.mutated, chain.names)

    def reduce_grads(self) -> None:
        """Sum each shared parameter's gradient over the stages that hold it."""
        for name, ranks in self.shared:
            if self.place.stage not in ranks:
                continue
            param = self.stage.tensors[name]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.peer.all_reduce_sum(param.grad, self._groups.get(ranks))
