"""Build only what a stage owns, with the values a plain ``torch.manual_seed(seed); model()`` gives.

Initial values come from one sequential random stream over every layer's initialisation, so they cannot be made for
a few layers alone; but the stream only depends on which random fills run, in which order, on tensors of which sizes,
not on where those tensors live. So the factory runs twice:

1. on the meta device (no memory, no randomness), recording the order in which parameters and buffers are registered
   on modules and the names they end up with in the model;
2. for real, with the same seed, where every parameter or buffer the stage does not own is swapped, the moment it is
   registered, for a view of a scratch buffer of its size: its initialisation still draws the same random numbers
   (so the stage's own tensors get exactly the plain values) but writes them into memory that is reused.

Peak memory is the stage's own tensors plus the largest single tensor. A factory whose second run registers
different tensors than its first, or that cannot build on the meta device, is built whole instead (and logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vpipe_lab.core.plan import Plan, Policy
from vpipe_lab.core.planning.partition import uniform
from vpipe_lab.runtime.engine.comm import Peer
from vpipe_lab.runtime.model.batches import describe, rebuild
from vpipe_lab.runtime.model.capture import CaptureError, Chain, build_model, canonical_names, capture
from vpipe_lab.runtime.model.units import get_tensor, set_tensor
from vpipe_lab.wire.jobspec import JobSpec

log = logging.getLogger(__name__)


Registration = tuple[nn.Module, str, Any]


def on_meta(factory: Callable[[], nn.Module], seed: int) -> tuple[nn.Module, list[Registration]]:
    """The model's structure without memory, and its parameter/buffer registrations in order."""
    order: list[Registration] = []

    def record(module: nn.Module, name: str, value: Any) -> None:
        order.append((module, name, value))

    hooks = [nn.modules.module.register_module_parameter_registration_hook(record),
             nn.modules.module.register_module_buffer_registration_hook(record)]
    try:
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = factory()
    finally:
        for hook in hooks:
            hook.remove()
    return model, order


TRANSIENT = ""  # a tensor the model registers and later replaces (a head's own weight before it is tied)


def registered_names(model: nn.Module, order: list[Registration]) -> list[str | None]:
    """For each registration, the canonical name its tensor has in the finished model; ``TRANSIENT`` when it is
    replaced before the end, None when its module is not part of the model."""
    paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
    canonical = canonical_names(model)
    out: list[str | None] = []
    for module, name, value in order:
        final = module._parameters.get(name) if name in module._parameters else module._buffers.get(name)
        if paths.get(id(module)) is None or final is None:
            out.append(None)
        else:
            out.append(canonical.get(id(final)) if final is value else TRANSIENT)
    return out


class _Scratch:
    """Reusable memory for tensors being initialised only for the random numbers they draw."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def like(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.dtype, t.device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < t.numel():
            buf = self.buffers[key] = torch.empty(max(t.numel(), 1), dtype=t.dtype, device=t.device)
        return buf[:t.numel()].view(t.shape)


def owned_only(factory: Callable[[], nn.Module], seed: int, names: list[str | None], keep: set[str]) -> nn.Module:
    """Run the factory for real; tensors registered under a name outside ``keep`` live in scratch memory."""
    scratch = _Scratch()
    made: set[int] = set()  # tensors already swapped: registering one again (a tie) keeps the tie
    count = 0

    def swap(module: nn.Module, name: str, value: Any) -> Any:
        nonlocal count
        k, count = count, count + 1
        if value is None or id(value) in made or k >= len(names) or names[k] is None or names[k] in keep:
            return None
        out = (nn.Parameter(scratch.like(value), requires_grad=value.requires_grad)
               if isinstance(value, nn.Parameter) else scratch.like(value))
        made.add(id(out))
        return out

    hooks = [nn.modules.module.register_module_parameter_registration_hook(swap),
             nn.modules.module.register_module_buffer_registration_hook(swap)]
    try:
        torch.manual_seed(seed)
        model = factory()
    finally:
        for hook in hooks:
            hook.remove()
    if count != len(names):
        raise RuntimeError(f"the model factory registered {count} tensors on its second run and {len(names)} on its "
                           "first: it does not build the same model every time")
    return model


# --- a stage's chain: what the worker builds at start-up ---------------------------------------------------------------
def build_chain(spec: JobSpec, factory: Any, split_at: Any, rank: int, world: int, peer: Peer,
                first_inputs: Callable[[], Any]) -> tuple[Chain, Plan]:
    """The model as units, with real tensors for this stage's units only, and the plan to start with. A model given
    as an instance was built by the caller and arrives whole; one that cannot be laid out on the meta device is built
    whole. ``first_inputs()`` (rank 0 only) gives one micro-batch of the first batch's inputs."""
    meta = order = layout = None
    if callable(factory) and not isinstance(factory, torch.nn.Module):
        try:
            meta, order = on_meta(factory, spec.settings.seed)
        except Exception as exc:  # a factory that needs real tensors to build (data-dependent init)
            log.info("the model does not build on the meta device (%s: %s); building it whole", type(exc).__name__, exc)
    model = meta if meta is not None else build_model(factory, spec.settings.seed)
    example = _example(model, split_at, rank, world, peer, first_inputs)
    scouted = _SCOUTED.pop() if _SCOUTED else None
    if meta is not None and order is not None and scouted is not None and scouted.serves(meta, order, example,
                                                                                         peer.device):
        layout = scouted.chain  # rank 0 cut this very model on these inputs a moment ago: no second capture
        log.info("the stage is laid out on the model as rank 0 cut it alone")
    elif meta is not None:
        try:
            layout = capture(meta.train(), rebuild(example, device=torch.device("meta")) if example else None, split_at,
                             peer.device)
        except Exception as exc:  # an op without a meta kernel, say; the real capture decides
            log.info("cannot lay the model out on the meta device (%s); building it whole", exc)
            model = build_model(factory, spec.settings.seed)
    if layout is None:
        chain = capture(model, rebuild(example) if example else None, split_at)
        return chain, initial_plan(spec, chain, rank, world, peer)
    assert meta is not None and order is not None
    plan = initial_plan(spec, layout, rank, world, peer)
    mine = [layout.tensors[i] for i in plan.layers_of(rank)]
    keep = {c for t in mine for _, c in t.params + t.buffers}
    model = owned_only(factory, spec.settings.seed, registered_names(meta, order), keep).train()
    real = {name: t for t in list(model.parameters()) + list(model.buffers())
            if (name := canonical_names(model).get(id(t))) is not None}
    try:  # the meta capture's graphs, computing with this stage's real tensors: no second export
        for i in plan.layers_of(rank):
            bind(layout.units[i], layout, i, real)
        return layout, plan
    except CaptureError as exc:
        log.info("the meta capture does not take real tensors (%s); capturing again", exc)
    chain = capture(model, rebuild(example) if example else None, split_at)
    if chain.signature() != layout.signature():
        raise RuntimeError("the model is cut differently on the meta device and for real; build it without "
                           "device-dependent code")
    return chain, plan


def bind(unit: nn.Module, chain: Chain, index: int, tensors: dict[str, torch.Tensor]) -> None:
    """Make ``unit`` (unit ``index`` of ``chain``) compute with ``tensors``, by canonical name; CaptureError if one
    is missing or the unit still has a tensor without values (a meta one) afterwards."""
    for local, name in chain.tensors[index].params + chain.tensors[index].buffers:
        if name not in tensors:
            if not get_tensor(unit, local).is_meta:  # a constant the capture lifted into the graph: it has values
                continue
            raise CaptureError(f"unit {chain.names[index]!r} needs {name!r}, which this stage does not hold")
        set_tensor(unit, local, tensors[name])
    left = [n for n, t in list(unit.named_parameters()) + list(unit.named_buffers()) if t.is_meta]
    if left:
        raise CaptureError(f"unit {chain.names[index]!r} still has tensors without values ({', '.join(left[:3])})")


@dataclass
class _Scouted:
    """Rank 0's cut of the model on the meta device (``unit_names``), for the stage it builds next (``build_chain``):
    the same registrations on the same inputs give the same units, so it is laid out on this cut, not captured again."""

    names: list[str | None]  # every registration's tensor's name in the model, in registration order
    example: Any
    chain: Chain

    def serves(self, meta: nn.Module, order: list[Registration], example: Any, device: torch.device | None) -> bool:
        """The stage's model and inputs are the scout's, and its device the one the scout traced as (the CPU: code
        that branches on the device would take another branch on a GPU)."""
        return ((device is None or device.type == "cpu") and registered_names(meta, order) == self.names
                and example == self.example)


_SCOUTED: list[_Scouted] = []  # at most one, taken by the next build_chain in this process


def unit_names(factory: Any, split_at: Any, seed: int, first_inputs: Callable[[], Any]) -> list[str]:
    """The model's partition units as rank 0 cuts it on its own, before any other rank starts (the controller's
    check that a pipeline of this many stages can be filled). Laid out on the meta device where it builds there, and
    then kept for the stage rank 0 builds next."""
    return list(unit_chain(factory, split_at, seed, first_inputs, keep=True).names)


def unit_chain(factory: Any, split_at: Any, seed: int, first_inputs: Callable[[], Any], keep: bool = False) -> Chain:
    """The model cut into its units in this process alone (``unit_names``; ``vpipe-lab export --model``), traced as on
    the CPU: the units and their names do not depend on the device. ``keep``: a cut on the meta device is kept for
    this process's next ``build_chain``."""
    model: nn.Module | None = None
    names: list[str | None] | None = None
    _SCOUTED.clear()
    if callable(factory) and not isinstance(factory, nn.Module):
        try:
            model, order = on_meta(factory, seed)
            names = registered_names(model, order) if keep else None  # before the capture touches the model
        except Exception:  # a factory that needs real tensors to build
            model = None
    meta = model is not None
    if model is None:
        model = build_model(factory, seed)
    example = None if isinstance(model, nn.Sequential) and split_at is None else describe(first_inputs())[0]
    try:
        chain = capture(model.train(), rebuild(example, device=torch.device("meta") if meta else None)
                        if example else None, split_at)
    except Exception:
        if not meta:
            raise
        model = build_model(factory, seed)  # an op without a meta kernel, say: the real capture decides
        chain = capture(model.train(), rebuild(example) if example else None, split_at)
        meta = False
    if keep and meta and names is not None:
        _SCOUTED.append(_Scouted(names, example, chain))
    return chain


def _example(model: nn.Module, split_at: Any, rank: int, world: int, peer: Peer,
             first_inputs: Callable[[], Any]) -> dict[str, Any] | None:
    """Rank 0 describes one micro-batch of the first batch's inputs to every rank, which captures the model on zeros
    of those shapes (only rank 0 reads data). An nn.Sequential needs no example."""
    if isinstance(model, torch.nn.Sequential) and split_at is None:
        return None
    desc = describe(first_inputs())[0] if rank == 0 else None
    return peer.broadcast_json(desc) if world > 1 else desc


def initial_plan(spec: JobSpec, chain: Chain, rank: int, world: int, peer: Peer) -> Plan:
    """The plan to start with, checked against the units every rank agrees on."""
    mine = chain.signature()
    if world > 1 and peer.broadcast_json(mine) != mine:
        raise RuntimeError(f"stage {rank} cut the model differently from stage 0: the model factory must "
                           "build the same model on every rank (seeded, no rank-dependent code)")
    chunks = world * spec.settings.chunks
    if len(chain) < chunks:
        raise ValueError(f"the model has {len(chain)} partition units ({', '.join(chain.names)}) but the pipeline has "
                         f"{chunks} stages (virtual ones included): every stage needs at least one unit; use at most "
                         f"{len(chain)}, or more split points")
    shards, replicas = spec.settings.shards, spec.settings.replicas  # the job's mesh, whatever a plan says
    if spec.plan is not None:
        plan = Plan.from_dict(spec.plan)
        if spec.resume_path is not None and plan.num_layers != len(chain):
            raise ValueError(f"the checkpoint {spec.resume_path} was saved over {plan.num_layers} partition units but "
                             f"the model cuts into {len(chain)} here ({', '.join(chain.names)}): resume with the split "
                             "it was saved with (launch(split=...), --split), or give a plan over these units")
        return plan.with_mesh(shards=shards, replicas=replicas).validate(len(chain), world)
    plan = Plan(uniform(len(chain), chunks), (Policy.KEEP,) * len(chain), spec.settings.microbatches,
                spec.settings.schedule, spec.settings.chunks)
    return plan.with_mesh(shards=shards, replicas=replicas).validate(len(chain), world)
