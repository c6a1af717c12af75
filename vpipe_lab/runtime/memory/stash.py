"""PipeDream's weight stashing on one stage: each micro-batch's forward and backward see the weights of one version,
and the stage updates them after every backward (the ``pipedream`` schedule, ``core/schedules/orders/stashing.py``).

A forward runs its layers through ``torch.func.functional_call`` with *aliases* of the stage's parameters: leaf
tensors over the parameters' memory (``p.data``, with a version counter of their own) that autograd saves and
accumulates gradients into, one set per weight version. After a micro-batch's backward its aliases' gradients become
the parameters' and the optimizer steps. The optimizer writes the parameters in place, so when forwards still in
flight use the live version the parameters first move to fresh memory (``p.data = p.data.clone()``): the old memory
stays with those forwards' aliases, as the stashed version, and is freed with their last backward. That is one copy
per older version still in flight, ``K - s - 1`` on stage ``s`` in the steady state, which the cost model charges.
The optimizer's state, the parameter objects and everything that refers to them stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from vpipe_lab.runtime.memory.ledger import tensor_bytes

Params = Sequence[tuple[str, torch.nn.Parameter]]


class WeightStash:
    """Which weight version each micro-batch in flight uses, the aliases of every version still needed, and the bytes
    of the stashed copies (the versions the live weights have left)."""

    def __init__(self) -> None:
        self.on = False
        self.version = 0  # updates applied this iteration: the live weights' version
        self.of_mb: dict[int, int] = {}  # micro-batch in flight -> the version its forward used
        self.aliases: dict[int, dict[str, torch.Tensor]] = {}  # version -> canonical name -> alias
        self.copies: dict[int, int] = {}  # stashed version -> its bytes (its memory is no longer the live weights')
        self.current = self.peak = 0  # stashed bytes now, and the most at once since ``reset_peak``

    def begin(self, mb: int, params: Params) -> None:
        """``mb``'s forward starts: it uses the live version (aliases made once per version)."""
        self.of_mb[mb] = self.version
        if self.version not in self.aliases:
            self.aliases[self.version] = {name: p.data.requires_grad_(p.requires_grad) for name, p in params}

    def call(self, module: torch.nn.Module, params: Sequence[tuple[str, str]], mb: int, x: Any) -> Any:
        """``module(x)`` on ``mb``'s version of its parameters (``params``: (local name, canonical name))."""
        aliases = self.aliases[self.of_mb[mb]]
        return torch.func.functional_call(module, {local: aliases[name] for local, name in params if name in aliases},
                                          (x,))

    def update(self, mb: int, params: Params, step: Callable[[], None]) -> bool:
        """``mb``'s backward is done: its gradients to the parameters, the live weights moved off memory that forwards
        in flight still read, ``step`` (the optimizer), the gradients dropped. Whether the parameters moved."""
        version = self.of_mb.pop(mb)
        aliases = self.aliases[version]
        for name, p in params:
            alias = aliases.get(name)
            if alias is not None:
                p.grad, alias.grad = alias.grad, None
        if version not in self.of_mb.values():
            self._forget(version)
        moved = self.version in self.of_mb.values()
        if moved:
            with torch.no_grad():
                for _, p in params:
                    p.data = p.data.clone()
            self.copies[self.version] = sum(tensor_bytes(p) for _, p in params)
            self.current += self.copies[self.version]
            self.peak = max(self.peak, self.current)
        step()
        for _, p in params:
            p.grad = None
        self.version += 1
        return moved

    def _forget(self, version: int) -> None:
        self.aliases.pop(version, None)
        self.current -= self.copies.pop(version, 0)

    def storages(self) -> set[int]:
        """The memory of every version still held: weights, not activations, to the saved-tensor accounting."""
        return {a.untyped_storage().data_ptr() for aliases in self.aliases.values() for a in aliases.values()}

    def reset(self) -> None:
        """A new iteration (or a dropped one): no micro-batch in flight, the live weights the only version."""
        self.of_mb.clear()
        self.aliases.clear()
        self.copies.clear()
        self.version = self.current = 0

    def reset_peak(self) -> int:
        """The most stashed bytes held at once since the last call."""
        peak, self.peak = self.peak, self.current
        return peak
