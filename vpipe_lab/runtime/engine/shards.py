"""A sharded stage: its units under torch's FSDP2 (``fully_shard`` over the stage's shard mesh), gathered and reduced
when the stage's ``Sharding`` says, by the executor, not by FSDP's own hooks.

Each unit is its own FSDP group (one all-gather and one reduce-scatter a unit, as torchtitan wraps each transformer
block), so a unit can arrive, leave or change policy without touching the others. Its parameters become DTensors
sharded on dim 0 over the stage's shard ranks (a 1-D mesh; with replicas, a 2-D (replica, shard) mesh: FSDP's HSDP,
which also all-reduces over the replicas); its gradients and the optimizer's state on them are sharded the same way.
A parameter several units use (a tied embedding and head, ``Chain.shared_params``) stays whole on every shard (FSDP's
``ignored_params``): two FSDP groups cannot hold one tensor, and the stages that hold a tie sum its gradient
themselves (``runtime/training/ties.py``); its gradient is averaged over the data-parallel ranks with the replicas'.

Inside an iteration FSDP only accumulates (``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``),
as torch.distributed.pipelining drives an FSDP stage. The executor makes the collectives explicit, so they are
timed and drawn as spans of their own: ``gather`` before a unit's forward (and, when the stage reshards after each
forward, before its backward), ``after_backward`` once a micro-batch's backward of a chunk is complete (its W too
under a split backward) reduce-scatters then under ``scatter``/``stream`` and reshards under
``regather``/``stream``, and ``finish`` reduce-scatters what is left and reshards every unit before the optimizer
step. The reduce is FSDP's own ``post_backward`` with the sync flags set, as torch's ``_PipelineStage`` calls it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard

from vpipe_lab.core.sharding import Sharding

log = logging.getLogger(__name__)


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (FSDP's sharded parameter, its gradient or optimizer state)."""
    return hasattr(t, "to_local") and hasattr(t, "placements")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its shard when it is a DTensor, else ``t``."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined,no-any-return]


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor's ``full_tensor()`` (collective over its mesh: every shard calls it together)."""
    return t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined,no-any-return]


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's shard, as it travels and is saved) as a DTensor laid out like ``param``; unchanged when
    ``param`` is not sharded or ``value`` is not shard-shaped (a 0-dim step counter)."""
    if not is_sharded(param) or is_sharded(value) or value.shape != local(param).shape or value.dim() == 0:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, param.device_mesh, param.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=param.shape, stride=param.stride())


def unwrap(module: torch.nn.Module) -> None:
    """Undo ``fully_shard`` on a unit that left this stage (its state was sent first): FSDP's hooks and state go,
    its class is its own again, and each parameter FSDP held becomes a meta tensor of its whole shape, so the unit is
    a plain shell that can arrive anywhere later and be sharded there afresh. FSDP2 has no inverse of
    ``fully_shard``; this undoes exactly what it did to the module (a class, two hooks, its composable state)."""
    if not isinstance(module, FSDPModule):
        return
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    module.reshard()
    for group in state._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            info = fsdp_param._module_info
            sharded = getattr(info.module, info.param_name)
            shell = torch.nn.Parameter(torch.empty(sharded.shape, dtype=sharded.dtype, device="meta"),
                                       requires_grad=sharded.requires_grad)
            for owner, name in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
                owner._parameters[name] = shell
    for handle in (getattr(state, "_pre_forward_hook_handle", None), getattr(state, "_post_forward_hook_handle", None)):
        if handle is not None:
            handle.remove()
    module.__dict__.pop(STATE_KEY, None)
    module.__dict__.pop(REGISTRY_KEY, None)
    _module_state_mapping.pop(module, None)
    module.__class__ = next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule))


class Shards:
    """The FSDP units of one stage and when they gather and reduce."""

    def __init__(self, mesh: Any, whole_names: set[str], sharding: Sharding = Sharding.HOLD) -> None:
        self.mesh = mesh  # the stage's shard mesh (1-D), or (replica, shard) for HSDP
        self.whole = set(whole_names)  # canonical names kept whole on every shard (ties)
        self.sharding = sharding
        self.split = False  # the schedule splits each backward into B and W (W's gradients come after B's hooks)
        self.units: dict[int, FSDPModule] = {}
        self._index: dict[int, int] = {}  # id(unit module) -> its index here (a kept unit may be renumbered)
        self._pending: set[int] = set()  # units whose gradients wait for a reduce-scatter
        self._storages: dict[int, set[int]] = {}  # unit -> its gathered parameters' storages (not activations)
        self.live: set[int] = set()  # their union, one set object the swap engine reads (``SwapEngine.gathered``)
        self.clock: Callable[[], float] | None = None  # the executor's marks, while an iteration runs
        self.spans: list[tuple[str, int, float, float]] = []  # (kind, unit, start, end) since the executor drained
        self.busy_s = 0.0  # wall seconds spent in the collectives so far (a profiling iteration's timer leaves it out)
        self.whole_peak = 0  # the most whole parameters and gradients held at once since ``reset_peak``
        # unit -> the most bytes FSDP's own hooks made whole inside its forward or backward (gathered parameters; a
        # reduce: the whole gradients with their reduce-scatter input): the allocator's meter saw them in the layer's
        # working set, which the cost model prices apart (``allocator.note`` takes them off)
        self.inside: dict[int, int] = {}
        self._explicit = 0  # inside the executor's own gather, reduce or reshard (not a layer's)

    @property
    def size(self) -> int:
        """Ranks each parameter is sharded over."""
        return int(self.mesh.size(-1))

    # --- units arrive and leave ----------------------------------------------------------------------------------
    def wrap(self, index: int, module: torch.nn.Module, names: Iterable[tuple[str, str]]) -> torch.nn.Module:
        """Shard unit ``index`` (its parameters' (attribute path, canonical name) are ``names``); a unit that is
        already sharded (it stays on this stage through a change) is taken as it is."""
        if not isinstance(module, FSDPModule):
            ignored = {module.get_parameter(local_name) for local_name, name in names if name in self.whole}
            fully_shard(module, mesh=self.mesh, reshard_after_forward=self.sharding.reshard_after_forward,
                        ignored_params=ignored or None)
            # after FSDP's own pre-forward (prepended): the storages it gathered into
            module.register_forward_pre_hook(lambda m, args: self._note(self._index.get(id(m), -1)))
            for group in fully_shard.state(module)._fsdp_param_groups:  # type: ignore[attr-defined]
                self._time(group, module)
        self._index[id(module)] = index
        unit = module
        assert isinstance(unit, FSDPModule)
        fully_shard.state(unit)._lazy_init()  # type: ignore[attr-defined]  # a root of its own
        self.units[index] = unit
        self._configure(unit)
        return module

    def _time(self, group: Any, module: torch.nn.Module) -> None:
        """Time FSDP's collectives on this group as spans (an all-gather: the group was sharded; a reduce-scatter:
        its gradients are reduced), wherever FSDP runs them: the executor's explicit calls, or FSDP's own hooks in a
        forward or backward; and forget a gathered storage when it is freed."""
        unshard, post_backward, reshard = group.unshard, group.post_backward, group.reshard

        def timed(kind: str, call: Callable[..., Any], runs: bool, *args: Any, **kwargs: Any) -> Any:
            if not runs:
                return call(*args, **kwargs)
            if not self._explicit:  # FSDP's own hook, inside a layer's forward or backward
                index = self._index.get(id(module), -1)
                # a reduce in a backward: the whole gradients it reduces were made in that backward too
                made = _group_bytes(group) * (2 if kind == "reduce_scatter" else 1)
                self.inside[index] = max(self.inside.get(index, 0), made)
            start, wall = self.clock() if self.clock is not None else 0.0, time.perf_counter()
            out = call(*args, **kwargs)
            self.busy_s += time.perf_counter() - wall
            if self.clock is not None:
                self.spans.append((kind, self._index.get(id(module), -1), start, self.clock()))
            return out

        def timed_unshard(*args: Any, **kwargs: Any) -> Any:
            out = timed("all_gather", unshard, not group.is_unsharded, *args, **kwargs)
            self.track()
            return out

        def timed_post_backward(*args: Any) -> Any:
            self.track()  # the unit's whole gradients, at their most, just before they are reduced
            return timed("reduce_scatter", post_backward, group.reduce_grads, *args)

        def forgetting_reshard() -> Any:
            out = reshard()
            if group.is_sharded:
                self._forget(self._index.get(id(module), -1))
            return out

        group.unshard, group.post_backward, group.reshard = timed_unshard, timed_post_backward, forgetting_reshard

    def release(self, index: int) -> None:
        """Unit ``index`` leaves the stage (its state was read first): whole parameters it held are freed."""
        unit = self.units.pop(index, None)
        if unit is not None:
            self._index.pop(id(unit), None)
        self._pending.discard(index)
        self._forget(index)
        if unit is not None:
            unit.reshard()

    def set_sharding(self, sharding: Sharding) -> None:
        """Gather and reduce as ``sharding`` says from the next iteration (between iterations: nothing is held)."""
        self.sharding = sharding
        for unit in self.units.values():
            self._configure(unit)

    def set_split(self, split: bool) -> None:
        """Whether the schedule splits the backward (B, then W): a split stage reduces after W, not in B's hooks."""
        if split != self.split:
            self.split = split
            for unit in self.units.values():
                self._configure(unit)

    def _configure(self, unit: FSDPModule) -> None:
        """FSDP's own hooks do what the stage's sharding lets them: under ``regather``/``stream`` each unit is
        gathered before its forward and its backward and resharded after each (per unit, so one unit's parameters
        are whole at a time); under ``stream`` (without a split backward) each unit's gradients are reduce-scattered
        as its backward ends, so one unit's are whole at a time. Everything else, the executor does
        (``after_backward``, ``finish``)."""
        mode = self.sharding
        unit.set_reshard_after_forward(mode.reshard_after_forward)
        unit.set_reshard_after_backward(mode.reshard_after_forward)
        in_backward = self._reduces_in_backward()
        unit.set_requires_gradient_sync(in_backward)
        unit.set_is_last_backward(in_backward)

    def _reduces_in_backward(self) -> bool:
        return self.sharding.reduce_per_microbatch and not self.split

    # --- inside an iteration ---------------------------------------------------------------------------------------
    def gather(self, indices: Iterable[int]) -> bool:
        """Before a chunk's forward: all-gather its units' parameters at once where the stage keeps them gathered
        (``hold``, ``scatter``); under ``regather``/``stream`` FSDP gathers each unit as it runs. Whether any was."""
        if self.sharding.reshard_after_forward:
            return False
        done = False
        with self._own():
            for i in indices:
                unit = self.units.get(i)
                if unit is not None and not self._gathered(unit):
                    unit.unshard()
                    self._note(i)
                    done = True
        return done

    def after_backward(self, indices: Iterable[int]) -> bool:
        """A micro-batch's backward of these units is complete (its W too, under a split backward): under
        ``scatter``/``stream`` reduce-scatter what FSDP's hooks left whole (all of it under ``scatter``, or W's
        gradients under a split ``stream``); whether a collective ran."""
        wanted = [i for i in indices if i in self.units]
        self._pending.update(wanted)
        if not self.sharding.reduce_per_microbatch:
            return False
        ran = False
        with self._own():
            for i in wanted:
                ran |= self._reduce(i, reshard=self.sharding.reshard_after_forward)
        return ran

    def finish(self) -> bool:
        """The iteration's backwards are done: reduce-scatter every gradient still whole, reshard every unit;
        whether a reduce-scatter ran. Every shard of the stage calls it at the same point."""
        self.track()
        reduced = False
        with self._own():
            for i in sorted(self._pending):
                reduced |= self._reduce(i, reshard=True)
            for i, unit in self.units.items():
                unit.reshard()
                self._forget(i)
        return reduced

    @contextmanager
    def _own(self) -> Iterator[None]:
        """The executor's own collectives (between layers: not a layer's working set)."""
        self._explicit += 1
        try:
            yield
        finally:
            self._explicit -= 1

    def discard(self) -> None:
        """A failed iteration: drop the whole gradients FSDP accumulated and free the gathered parameters."""
        self._pending.clear()
        for i, unit in self.units.items():
            unit.reset_iter_state()  # in-flight collectives waited for, trackers cleared (FSDP's recovery)
            for group in fully_shard.state(unit)._fsdp_param_groups:  # type: ignore[attr-defined]
                for fsdp_param in group.fsdp_params:
                    if hasattr(fsdp_param, "_unsharded_param"):
                        fsdp_param.unsharded_param.grad = None
                    fsdp_param.unsharded_accumulated_grad = None
            unit.reshard()
            self._forget(i)

    def _reduce(self, index: int, reshard: bool) -> bool:
        """FSDP's own post-backward for one unit with the sync flags set (as torch's ``_PipelineStage`` calls it):
        the reduce-scatter of its whole gradients into the sharded ones (adding to what is there); whether it had
        any whole gradient to reduce."""
        unit = self.units[index]
        self._pending.discard(index)
        groups = fully_shard.state(unit)._fsdp_param_groups  # type: ignore[attr-defined]
        if not any(_has_whole_grad(p) for g in groups for p in g.fsdp_params):
            if reshard:
                unit.reshard()
            return False
        unit.set_requires_gradient_sync(True)
        unit.set_reshard_after_backward(reshard)
        unit.set_is_last_backward(True)
        state = fully_shard.state(unit)  # type: ignore[attr-defined]
        for each in state._state_ctx.all_states:
            for group in each._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        self._configure(unit)
        return True

    def whole_bytes(self) -> tuple[int, int]:
        """(whole parameters gathered, whole gradients held) on this rank now, over every unit."""
        params = grads = 0
        for unit in self.units.values():
            for group in fully_shard.state(unit)._fsdp_param_groups:  # type: ignore[attr-defined]
                for fsdp_param in group.fsdp_params:
                    if not hasattr(fsdp_param, "_unsharded_param"):
                        continue
                    whole = fsdp_param.unsharded_param
                    if group.is_unsharded:
                        params += whole.numel() * whole.element_size()
                    for grad in (whole.grad, fsdp_param.unsharded_accumulated_grad):
                        if grad is not None:
                            grads += grad.numel() * grad.element_size()
        return params, grads

    def track(self) -> None:
        """Note the whole bytes held now toward ``whole_peak`` (at each gather and before each reduce)."""
        self.whole_peak = max(self.whole_peak, sum(self.whole_bytes()))

    def is_gathered(self, index: int) -> bool:
        unit = self.units.get(index)
        return unit is not None and self._gathered(unit)

    @contextmanager
    def kept(self, index: int) -> Iterator[None]:
        """Unit ``index`` is not resharded after a forward run inside (a probe of a gathered unit)."""
        unit = self.units[index]
        unit.set_reshard_after_forward(False)
        unit.set_reshard_after_backward(False)
        try:
            yield
        finally:
            self._configure(unit)

    @staticmethod
    def _gathered(unit: FSDPModule) -> bool:
        groups = fully_shard.state(unit)._fsdp_param_groups  # type: ignore[attr-defined]
        return all(g.is_unsharded for g in groups)

    def _note(self, index: int) -> None:
        """Unit ``index``'s gathered parameters' storages, so saved-tensor accounting takes them for weights."""
        unit = self.units.get(index)
        if unit is None:
            return
        found: set[int] = set()
        for group in fully_shard.state(unit)._fsdp_param_groups:  # type: ignore[attr-defined]
            if not group.is_unsharded:
                continue
            for fsdp_param in group.fsdp_params:
                storage = fsdp_param.unsharded_param.untyped_storage()
                if storage.nbytes():
                    found.add(storage.data_ptr())
        self._storages[index] = found
        self._refresh()

    def _forget(self, index: int) -> None:
        if self._storages.pop(index, None) is not None:
            self._refresh()

    def _refresh(self) -> None:
        self.live.clear()
        for found in self._storages.values():
            self.live.update(found)

    # --- whole for a moment ----------------------------------------------------------------------------------------
    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit's parameters whole (an evaluation pass), resharded after."""
        for i, unit in self.units.items():
            if not self._gathered(unit):
                unit.unshard()
                self._note(i)
        try:
            yield
        finally:
            for i, unit in self.units.items():
                unit.reshard()
                self._forget(i)


def _group_bytes(group: Any) -> int:
    """The bytes one FSDP group holds whole: its parameters gathered (and as many in their whole gradients)."""
    total = 0
    for fsdp_param in group.fsdp_params:
        numel = 1
        for size in getattr(fsdp_param, "_orig_size", ()):
            numel *= int(size)
        total += numel * fsdp_param.sharded_param.element_size()
    return total


def _has_whole_grad(fsdp_param: Any) -> bool:
    """Whether FSDP holds a whole (unsharded) gradient of this parameter waiting for its reduce-scatter."""
    if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
        return True
    return hasattr(fsdp_param, "_unsharded_param") and fsdp_param.unsharded_param.grad is not None
