"""Live reconfiguration at an iteration boundary: plan changes, live layer migration and model changes.

Every rank runs the same steps at the same boundary (the command came in rank 0's broadcast):

1. agree on memory: each receiver checks the parameters and optimizer state coming to it against its budget, and
   all ranks learn whether anyone refuses (then nothing changes);
2. optionally checkpoint every layer first, the state to recover if a worker dies during the move;
3. stream each moving layer's parameters, buffers and optimizer state straight to its new stage (JSON metadata plus
   raw tensors, point-to-point; nothing pickled);
4. agree that every transfer arrived, then commit: senders drop the layers, receivers adopt them. A layer is never
   in two stages or in none.
Processes and the process group stay up; the pipeline pauses only for the transfer. The worker
(``runtime/worker.py``) owns the plan and the chain; a ``Migration`` returns the new ones and the worker takes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from vpipe_lab.core.plan import Plan, Policy
from vpipe_lab.core.planning.layer_moves import match_layers, owners
from vpipe_lab.core.planning.partition import uniform
from vpipe_lab.runtime.engine import faults
from vpipe_lab.runtime.engine.comm import TAG_MIGRATE, Peer
from vpipe_lab.runtime.engine.device import Clock, Placement
from vpipe_lab.runtime.engine.shards import unwrap
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.memory.ledger import local_tensor, unit_static_bytes
from vpipe_lab.runtime.model.batches import rebuild
from vpipe_lab.runtime.model.capture import Chain, UnitTensors, build_model, capture, to_meta
from vpipe_lab.runtime.model.units import get_tensor, set_tensor
from vpipe_lab.runtime.training.place import Place
from vpipe_lab.runtime.training.ties import Ties
from vpipe_lab.wire.codec import Body
from vpipe_lab.wire.events import Failure, Migrated, Refusal

log = logging.getLogger(__name__)


def flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """JSON-able structure with tensors replaced by references into ``tensors`` (dict keys keep their types)."""
    if isinstance(obj, torch.Tensor):  # a sharded stage's DTensor travels as this rank's shard, to the same shard
        tensors.append(local_tensor(obj).detach())
        return {"__t__": len(tensors) - 1}
    if isinstance(obj, dict):
        return {"__d__": [[flatten(k, tensors), flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [flatten(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot migrate optimizer or module state of type {type(obj).__name__}: only tensors, numbers, "
                    "strings and containers of them cross between stages")


def unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__t__" in obj:
            return tensors[obj["__t__"]]
        if "__d__" in obj:
            return {unflatten(k, tensors): unflatten(v, tensors) for k, v in obj["__d__"]}
        if "__tuple__" in obj:
            return tuple(unflatten(v, tensors) for v in obj["__tuple__"])
    if isinstance(obj, list):
        return [unflatten(v, tensors) for v in obj]
    return obj


def signature(module: torch.nn.Module) -> str:
    """What identifies a layer across model versions: its class and its parameters' names and shapes."""
    shapes = ",".join(f"{n}:{tuple(p.shape)}" for n, p in module.named_parameters())
    return f"{type(module).__name__}({shapes})"


def layer_state(stage: Stage, index: int) -> dict[str, Any]:
    """What a layer takes with it (``Stage.unit_state``)."""
    return stage.unit_state(index)


def renamed(state: dict[str, Any], old: UnitTensors, new: UnitTensors) -> dict[str, Any]:
    """A layer's state under the names its tensors have in a new model version (NAS shifts layer indices)."""
    names = {o: n for (_, o), (_, n) in zip(old.params + old.buffers, new.params + new.buffers)}
    return {**state, "tensors": {names[k]: v for k, v in state["tensors"].items()},
            "optimizer": {names[k]: v for k, v in state["optimizer"].items()},
            "groups": [{**g, "params": [names[n] for n in g["params"]]} for g in state.get("groups", [])]}


def materialise(unit: torch.nn.Module, tensors: UnitTensors, values: dict[str, torch.Tensor],
                device: torch.device) -> dict[str, torch.Tensor]:
    """Fill a shell unit's parameters and buffers with ``values`` (by canonical name), on ``device``. A value that is
    a shard (a sharded stage's parameter: not the shell's shape) is returned instead, to be copied into the stage's
    shard once the stage has sharded the unit (``Stage.load_shards``)."""
    shards: dict[str, torch.Tensor] = {}
    for local, name in tensors.params:
        old = get_tensor(unit, local)
        value = values[name]
        if value.shape != old.shape:
            shards[name] = value
            value = torch.empty(old.shape, dtype=value.dtype)  # filled from the shards once sharded like them
        set_tensor(unit, local, torch.nn.Parameter(value.to(device), requires_grad=old.requires_grad))
    for local, name in tensors.buffers:
        set_tensor(unit, local, values[name].to(device))
    return shards


def new_model(factory: Callable[[], Any], seed: int, old: Chain, old_plan: Plan, world: int,
              mapping: dict[str, Any] | None, plan: dict[str, Any] | None, example: dict[str, Any] | None = None,
              split: Any = None) -> tuple[Chain, dict[int, int | None], Plan]:
    """A new model version (``Session.set_model``): its chain, which old unit each new unit takes its state from
    (None: fresh), and its plan. Every rank computes the same answer: units matched by signature (an nn.Sequential
    child by class and parameter shapes; a captured unit also by its module path, so a unit keeps its state when its
    name and shapes are unchanged), an even split, policies carried over. Any other model is captured on
    ``example`` (this shape epoch's micro-batch, described), as the first one was."""
    model = build_model(factory, seed)
    if isinstance(model, torch.nn.Sequential) and split is None:
        chain = capture(model, None, None)
    elif example is None:
        raise ValueError("the new model must be captured on a micro-batch, and none has run yet: train an "
                         "iteration before set_model")
    else:
        chain = capture(model, rebuild(example), split)
    if len(chain) < world:
        raise ValueError(f"the new model has {len(chain)} partition units ({', '.join(chain.names)}), fewer than "
                         f"the {world} stages: every stage needs one")
    if mapping is not None:
        sources = {int(j): (None if i is None else int(i)) for j, i in mapping.items()}
    else:
        sources = match_layers([signature(m) for m in old.units], [signature(m) for m in chain.units])
    if plan is not None:
        return chain, sources, Plan.from_dict(plan).validate(len(chain), world)
    policies = [old_plan.policies[i] if i is not None else Policy.KEEP for _, i in sorted(sources.items())]
    v = old_plan.virtual_stages
    return chain, sources, Plan(uniform(len(chain), world * v), tuple(policies), old_plan.microbatches,
                                old_plan.schedule, v, old_plan.shards, old_plan.replicas)


@dataclass(frozen=True)
class Reconfigured:
    """What a reconfiguration did, as rank 0 acknowledges it: ``ok``, or the ``error`` (and, when a receiver lacked
    memory, who ``refused``); the bytes moved over all ranks, the pause, the plan version and the chain's length."""

    ok: bool
    pause_s: float
    error: str | None = None
    refused: Refusal | None = None
    moved_bytes: int | None = None
    version: int | None = None
    layers: int | None = None


@dataclass
class Outcome:
    """A reconfiguration's result and the chain in force after it."""

    result: Reconfigured
    chain: Chain


@dataclass(frozen=True)
class Routes:
    """Where this rank's layers go: (new index, old index, peer) sends and receives, (new, old) that stay, and new
    layers that start fresh here."""

    sends: list[tuple[int, int, int]]
    recvs: list[tuple[int, int, int]]
    stays: list[tuple[int, int]]
    fresh: list[int]

    @classmethod
    def of(cls, rank: int, current: Plan, plan: Plan, sources: dict[int, int | None]) -> Routes:
        old_owner = owners(current.boundaries, current.stages, current.placement)
        new_owner = owners(plan.boundaries, plan.stages, plan.placement)
        pairs = [(j, i) for j, i in sorted(sources.items())]
        return cls([(j, i, new_owner[j]) for j, i in pairs if i is not None and old_owner[i] == rank != new_owner[j]],
                   [(j, i, old_owner[i]) for j, i in pairs if i is not None and new_owner[j] == rank != old_owner[i]],
                   [(j, i) for j, i in pairs if i is not None and old_owner[i] == rank == new_owner[j]],
                   [j for j, i in pairs if i is None and new_owner[j] == rank])


class MigrationHost(Protocol):
    """What a rank's part in a move needs of the worker it runs in (``runtime/worker.py``'s ``Worker``)."""

    place: Place
    placement: Placement
    peer: Peer
    stage: Stage
    ties: Ties
    clock: Clock

    def send(self, body: Body) -> None:
        """Report to the controller."""

    def save(self, root: Path) -> str | None:
        """Checkpoint the job under ``root``; the problem if it could not."""


class Migration:
    """One rank's part in moving layers between stages: this rank is stage ``place.stage`` of its data-parallel
    pipeline ``place.dp`` (each of the ``place.dps`` pipelines moves the same layers)."""

    def __init__(self, host: MigrationHost) -> None:
        self.host, self.place = host, host.place
        self.peer, self.stage, self.ties, self.clock = host.peer, host.stage, host.ties, host.clock
        self.device = host.placement.device

    def reconfigure(self, current: Plan, chain_now: Chain, plan: Plan, sources: dict[int, int | None],
                    new_chain: Chain | None, checkpoint: str | None, version: int, iteration: int,
                    budget: int | None) -> Outcome:
        """Move from ``current`` to ``plan``; new layer j takes old layer ``sources[j]``'s state (None: fresh from
        ``new_chain``). Nothing changes unless the result says ok. The steps are the module docstring's."""
        start = time.perf_counter()
        routes = Routes.of(self.place.stage, current, plan, sources)

        def refused(error: str, refusal: Refusal | None = None) -> Outcome:
            return Outcome(Reconfigured(False, time.perf_counter() - start, error, refusal), chain_now)

        problem = self.ties.conflict(plan, new_chain)  # every rank finds the same answer: nothing moves
        if problem is not None:
            return refused(problem)
        refusal = self._agree_memory(routes, budget, iteration, version)
        if refusal is not None:
            return refused("a receiving stage lacks memory for the incoming layers; nothing moved", refusal)
        problem = self._safety_net(routes, checkpoint)
        if problem is not None:  # every rank got the same verdict: move nothing without the safety net
            return refused(f"the checkpoint before the migration failed ({problem}); nothing moved "
                           "(apply(plan, checkpoint=False) moves without one)")
        saved_at = time.perf_counter()
        moved, arrived = self._transfer(routes, new_chain, iteration)
        chain = self._commit(routes, arrived, chain_now, new_chain, plan)
        pause = time.perf_counter() - start
        now = self.clock.now()
        if self.place.dp == 0:  # the other replicas moved the same layers at the same boundary
            self.host.send(Migrated(self.place.stage, version, iteration, moved, pause, time.perf_counter() - saved_at,
                               [j for j, _, _ in routes.recvs], [j for j, _, _ in routes.sends], (now - pause, now)))
        total = self.peer.all_sum([float(moved), pause])
        return Outcome(Reconfigured(True, pause, moved_bytes=int(total[0]), version=version, layers=len(chain)), chain)

    def _agree_memory(self, routes: Routes, budget: int | None, iteration: int, version: int) -> Refusal | None:
        """Step 1: everyone learns what comes to whom, receivers check their budgets, all agree; the refusal (who,
        needing how much of what budget) when any receiver cannot take its layers."""
        stage, rank = self.stage, self.place.stage
        sizes = {i: unit_static_bytes(stage.unit_state(i)) for _, i, _ in routes.sends}  # each leaving layer once
        incoming = [0.0] * self.place.stages
        for _, i, dst in routes.sends:
            incoming[dst] += sizes[i]
        incoming = [v / self.place.dps for v in self.peer.all_sum(incoming)]  # each replica added the same
        outgoing = sum(sizes.values())
        after = sum(stage.static_bytes().values()) - outgoing + int(incoming[rank])
        refuse = budget is not None and after > budget
        # The verdict carries who refused and by how much, so rank 0's acknowledgement says it (a separate message
        # from the refusing stage could arrive after the acknowledgement).
        mine = [1.0, float(rank), float(after), float(budget or 0)] if refuse else [0.0, -1.0, 0.0, 0.0]
        verdict = self.peer.all_max(mine)
        if verdict[0] <= 0:
            return None
        if refuse:
            self.host.send(Failure("migration", rank, replica=self.place.dp, iteration=iteration, needed=after,
                              budget=budget or 0, incoming=int(incoming[rank]), version=version))
        return Refusal(int(verdict[1]), int(verdict[2]), int(verdict[3]))

    def _safety_net(self, routes: Routes, checkpoint: str | None) -> str | None:
        """Step 2: the state to fall back on if a worker dies during the move; the problem if it was not written.
        Every rank takes part in the same collectives: whether anything moves anywhere is agreed by all of them (a
        rank with nothing to move must still join the checkpoint's collectives)."""
        if checkpoint and self.peer.all_max([float(bool(routes.sends or routes.recvs))])[0] > 0:
            return self.host.save(Path(checkpoint))
        return None

    def _transfer(self, routes: Routes, new_chain: Chain | None, iteration: int
                  ) -> tuple[int, dict[int, dict[str, Any]]]:
        """Step 3: sends are asynchronous, receives in the senders' order (ascending layer index per pair); the
        bytes this rank sent and the states that arrived, by new layer index."""
        fault = faults.parse()
        moved = 0
        for j, i, dst in routes.sends:
            tensors: list[torch.Tensor] = []
            state = self.stage.unit_state(i)
            if new_chain is not None:
                state = renamed(state, self.stage.layers[i].tensors, new_chain.tensors[j])
            meta = flatten(state, tensors)
            self.peer.send_json({"layer": j, "meta": meta, "count": len(tensors)}, dst, TAG_MIGRATE)
            for t in tensors:
                self.peer.send(t, dst, TAG_MIGRATE)
                moved += t.numel() * t.element_size()
            faults.hit(fault, "migrate", self.place.stage, iteration)
        arrived: dict[int, dict[str, Any]] = {}
        for j, _, src in routes.recvs:
            head = self.peer.recv_json(src, TAG_MIGRATE)
            if head["layer"] != j:
                raise RuntimeError(f"migration out of order: expected layer {j} from rank {src}, got {head['layer']}")
            tensors = [self.peer.recv(src, TAG_MIGRATE)[0] for _ in range(head["count"])]
            arrived[j] = unflatten(head["meta"], tensors)
            faults.hit(fault, "migrate", self.place.stage, iteration)  # a receiver dying with a layer half-adopted
        self.peer.flush()
        return moved, arrived

    def _commit(self, routes: Routes, arrived: dict[int, dict[str, Any]], chain_now: Chain, new_chain: Chain | None,
                plan: Plan) -> Chain:
        """Step 4, once every rank has everything it needs: layers that stay keep their modules; arriving ones fill
        the chain's shells (a new model's chain brings its own fresh layers); a tie arriving where its weight is
        already held binds to that one tensor. Returns the chain in force."""
        self.peer.barrier()
        stage = self.stage
        chain = new_chain if new_chain is not None else chain_now
        kept = {j: stage.layers[i] for j, i in routes.stays}
        # What stays keeps its optimizer state and groups by name across taking the layers apart and back together.
        held = {j: stage.unit_state(i) for j, i in routes.stays}
        if new_chain is not None:  # kept layers' tensors take their names in the new model
            held = {j: renamed(held[j], stage.layers[i].tensors, new_chain.tensors[j]) for j, i in routes.stays}
        for index in list(stage.owned):
            layer = stage.remove_layer(index)
            if not any(layer is k for k in kept.values()):
                unwrap(layer.module)  # a sharded unit leaves as a plain shell (engine/shards.py)
                to_meta(layer.module, layer.tensors)
        for j, layer in sorted(kept.items()):
            stage.add_layer(j, self._kept_module(j, layer, chain, new_chain), chain.tensors[j], held[j]["groups"],
                            held[j]["optimizer"])
        for j, state in arrived.items():
            shards = materialise(chain.units[j], chain.tensors[j], state["tensors"], self.device)
            stage.add_layer(j, chain.units[j], chain.tensors[j], state.get("groups"), state["optimizer"])
            stage.load_values(shards, local=True)  # shard k of a stage arrives from shard k of another
        for j in routes.fresh:
            stage.add_layer(j, chain.units[j], chain.tensors[j])
        stage.set_policies({j: plan.policies[j] for j in stage.owned})
        stage.reset_stats()
        if new_chain is not None:
            for j, unit in enumerate(new_chain.units):
                if j not in stage.layers:
                    to_meta(unit, new_chain.tensors[j])
        self.ties.refresh(plan, chain)
        return chain

    @staticmethod
    def _kept_module(j: int, layer: Any, chain: Chain, new_chain: Chain | None) -> Any:
        """The module a layer that stays runs as: its own, a new model's captured graph over its tensors, or its own
        taking its place (and its tensors' names) in the new model."""
        module = layer.module
        if new_chain is not None and new_chain.graph:  # a captured unit runs the new graph, over its own tensors
            module = new_chain.units[j]
            for (local, _), (old, _) in zip(chain.tensors[j].params + chain.tensors[j].buffers,
                                            layer.tensors.params + layer.tensors.buffers):
                set_tensor(module, local, get_tensor(layer.module, old))
        elif new_chain is not None:  # a kept layer takes its place in the new model
            new_chain.units[j] = module
        return module
