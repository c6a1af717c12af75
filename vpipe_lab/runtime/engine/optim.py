"""A stage's one optimizer, with a parameter group per unit, so a unit can leave or arrive without a rebuild.

The user's factory (``params -> optimizer``) is called on each arriving unit's parameters: the first call's optimizer
becomes the stage's, later calls only lend their parameter groups (with whatever per-parameter options the factory
sets, such as no weight decay on biases) to ``add_param_group``. Every group is tagged with the unit it belongs to.
A migrating unit takes its groups' options (a learning rate a scheduler changed, say) and each parameter's state to
its new stage, where they are restored instead of the factory's defaults. A weight tied between units sits in one
group only: the first unit here that uses it; when that unit leaves, the group stays with the next unit using it.
Adding or removing a unit costs time in its own size, not the stage's.

A learning-rate scheduler (``optimizer -> scheduler``) is built on the stage's optimizer and stepped once per
iteration (under PipeDream too, whose ``update`` steps the optimizer after every micro-batch). Its lists are per
group, so it is rebuilt whenever the groups change (a unit arrives or leaves, a checkpoint is loaded); the rebuilt one
continues at the iteration it was built at (``last_epoch``) from each group's current learning rate and
``initial_lr``, which travel with the group. That is exact for the schedulers whose next value depends only on the
step count, ``initial_lr`` and the current ``lr`` (LambdaLR, StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR,
LinearLR, PolynomialLR), not for ones that hold other schedulers (SequentialLR, ChainedScheduler) or extra history
(ReduceLROnPlateau, OneCycleLR's phases are closed-form and work).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from vpipe_lab.runtime.engine.shards import like

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
UNIT = "vpipe_unit"  # the key tagging a parameter group with its unit's index


def _options(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", UNIT)}


class StageOptimizer:
    """The one ``torch.optim.Optimizer`` of a stage and which unit each of its groups belongs to."""

    def __init__(self, factory: OptimizerFactory | None, device: torch.device,
                 scheduler: SchedulerFactory | None = None) -> None:
        self.factory = factory
        self.device = device
        self.optimizer: torch.optim.Optimizer | None = None
        self.names: dict[torch.Tensor, str] = {}  # parameter -> canonical name, for every parameter in a group
        self.scheduler_factory = scheduler
        self.scheduler: Any = None
        self._stale = True  # the groups changed since the scheduler was built

    def holds(self, p: torch.Tensor) -> bool:
        return p in self.names

    def add_unit(self, unit: int, params: Sequence[tuple[str, torch.nn.Parameter]],
                 groups: list[dict[str, Any]] | None = None, states: dict[str, dict[str, Any]] | None = None) -> None:
        """Give ``unit``'s parameters that no group here holds yet a group (or the groups it brought: ``groups``
        as ``unit_groups`` describes them) and their state from ``states`` (by name) when given."""
        if self.factory is None:
            return
        new = [(n, p) for n, p in params if not self.holds(p)]
        if not new:
            return
        if self.optimizer is None and not groups:
            # The factory's own optimizer becomes the stage's: its class, defaults and groups.
            self.optimizer = self.factory([p for _, p in new])
            for group in self.optimizer.param_groups:
                group[UNIT] = unit
        else:
            by_name = dict(new)
            if groups:  # the unit's own groups, as it had them on its last stage
                made = [{**g["options"], "params": [by_name.pop(n) for n in g["params"] if n in by_name]}
                        for g in groups]
                made = [g for g in made if g["params"]]
                if by_name:  # a parameter the description did not name: the factory's options for it
                    made += self._fresh(list(by_name.values()))
            else:
                made = self._fresh([p for _, p in new])
            if self.optimizer is None:  # the factory's optimizer, emptied: its class and defaults are the stage's
                self.optimizer = self.factory([p for _, p in new])
                self.optimizer.param_groups.clear()
                self.optimizer.state.clear()
            for group in made:
                group[UNIT] = unit
                self.optimizer.add_param_group(group)
        self.names.update({p: n for n, p in new})
        self._stale = True
        for name, p in new:
            if states and name in states:
                self.optimizer.state[p] = self._put(states[name], p)

    def _put(self, state: dict[str, Any], param: torch.Tensor) -> dict[str, Any]:
        """A parameter's saved state on this stage's device (0-dim step counters stay where the optimizer keeps
        them); for a sharded parameter, a shard that travelled as a plain tensor becomes a DTensor like it."""
        return {k: like(v.to(self.device), param) if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in state.items()}

    def _fresh(self, params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        assert self.factory is not None
        lent = self.factory(params)
        return [{**_options(g), "params": list(g["params"])} for g in lent.param_groups]

    def unit_groups(self, unit: int) -> list[dict[str, Any]]:
        """The unit's groups as plain data: their options and their parameters' names."""
        if self.optimizer is None:
            return []
        return [{"options": _options(g), "params": [self.names[p] for p in g["params"]]}
                for g in self.optimizer.param_groups if g.get(UNIT) == unit]

    def remove_unit(self, unit: int, stays: dict[str, int]) -> None:
        """Drop the unit's groups and the state of its parameters; a parameter in ``stays`` (name -> another unit
        here that uses it: a tie) keeps its group and state, now under that unit."""
        if self.optimizer is None:
            return
        kept: list[dict[str, Any]] = []
        for group in self.optimizer.param_groups:
            if group.get(UNIT) != unit:
                kept.append(group)
                continue
            remaining = []
            for p in group["params"]:
                name = self.names[p]
                if name in stays:
                    remaining.append(p)
                else:
                    self.optimizer.state.pop(p, None)
                    del self.names[p]
            if remaining:
                group["params"] = remaining
                group[UNIT] = min(stays[self.names[p]] for p in remaining)
                kept.append(group)
        self.optimizer.param_groups[:] = kept
        self._stale = True

    def state(self, names: Sequence[str], tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
        """Each named parameter's optimizer state (those that have one)."""
        if self.optimizer is None:
            return {}
        out = {}
        for name in names:
            p = tensors.get(name)
            if p is not None and p in self.optimizer.state:
                out[name] = dict(self.optimizer.state[p])
        return out

    def load(self, states: dict[str, dict[str, Any]], groups: list[dict[str, Any]] | None,
             tensors: dict[str, torch.Tensor]) -> None:
        """Put back saved state (by parameter name) and saved group options (a checkpoint's): the group holding a
        named parameter takes the options saved for it."""
        if self.optimizer is None:
            return
        for name, state in states.items():
            p = tensors.get(name)
            if p is not None and p in self.names:
                self.optimizer.state[p] = self._put(state, p)
        for saved in groups or []:
            wanted = {tensors[n] for n in saved["params"] if n in tensors}
            for group in self.optimizer.param_groups:
                if any(p in wanted for p in group["params"]):
                    group.update(saved["options"])
        self._stale = True

    def _ready(self, iteration: int) -> None:
        if self.scheduler_factory is not None and (self.scheduler is None or self._stale):
            self._schedule(iteration)

    def update(self, iteration: int) -> None:
        """One optimizer step inside ``iteration`` without the scheduler's (PipeDream's update after each
        micro-batch; the learning-rate schedule still steps once per iteration, in ``step``)."""
        if self.optimizer is not None and self.optimizer.param_groups:
            self._ready(iteration)
            self.optimizer.step()

    def lr(self) -> float | None:
        """The first group's learning rate (what a log shows), None without an optimizer."""
        if self.optimizer is None or not self.optimizer.param_groups:
            return None
        return float(self.optimizer.param_groups[0]["lr"])

    def _schedule(self, iteration: int) -> None:
        """Build the scheduler for the groups in force, continuing at ``iteration`` (see the module docstring)."""
        assert self.optimizer is not None and self.scheduler_factory is not None
        groups = self.optimizer.param_groups
        carried = bool(groups) and all("initial_lr" in g for g in groups)
        lrs = [g["lr"] for g in groups]
        self.scheduler = self.scheduler_factory(self.optimizer)  # sets initial_lr where missing, lr to step 0's
        if carried and iteration > 0:
            for group, lr in zip(groups, lrs):
                group["lr"] = lr
            self.scheduler.last_epoch = iteration
            self.scheduler._step_count = iteration + 1  # it has stepped before: no "step order" warning
            self.scheduler._last_lr = list(lrs)
        self._stale = False

    def step(self, iteration: int = 0, skip: bool = False) -> float | None:
        """The optimizer step of ``iteration`` (not when ``skip``: an fp16 overflow, or PipeDream, whose updates
        ``update`` made during the iteration), then the scheduler's; returns the learning rate it stepped with (the
        first group's)."""
        if self.optimizer is None or not self.optimizer.param_groups:
            return None
        self._ready(iteration)
        lr = self.lr()
        if not skip:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return lr
