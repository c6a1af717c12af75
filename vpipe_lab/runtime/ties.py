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
    from vpipe_lab.runtime.worker import Worker


def holders(plan_layers: list[list[int]], unit_params: list[list[str]]) -> list[tuple[str, tuple[int, ...]]]:
    """(parameter, the stages holding it) for each parameter held by more than one stage, in a fixed order."""
    where: dict[str, set[int]] = {}
    for stage, layers in enumerate(plan_layers):
        for i in layers:
            for name in unit_params[i]:
                where.setdefault(name, set()).add(stage)
    return sorted((name, tuple(sorted(ranks))) for name, ranks in where.items() if len(ranks) > 1)


class Ties:
    """The tied parameters of the plan in force and the process groups that reduce their gradients."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._groups: dict[tuple[int, ...], Any] = {}
        self.shared: list[tuple[str, tuple[int, ...]]] = []
        self.refresh()

    def refresh(self) -> None:
        """Recompute after a plan change; every rank runs this at the same boundary (group creation is collective)."""
        w = self.worker
        plan_layers = [list(w.plan.layers_of(s)) for s in range(w.world)]
        self.shared = holders(plan_layers, [[c for _, c in t.params] for t in w.chain.tensors])
        for ranks in sorted({r for _, r in self.shared}):
            if ranks not in self._groups and len(ranks) < w.world:
                self._groups[ranks] = dist.new_group(list(ranks))

    def reduce_grads(self) -> None:
        """Sum each shared parameter's gradient over the stages that hold it."""
        w = self.worker
        for name, ranks in self.shared:
            if w.rank not in ranks:
                continue
            param = w.stage.tensors[name]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            w.peer.all_reduce_sum(param.grad, self._groups.get(ranks))
