"""Live reconfiguration at an iteration boundary: plan changes, live layer migration, checkpoints and model changes.

Every rank runs the same steps at the same boundary (the command came in rank 0's broadcast):

1. agree on memory: each receiver checks the parameters and optimizer state coming to it against its budget, and
   all ranks learn whether anyone refuses (then nothing changes);
2. optionally checkpoint every layer first, the state to recover if a worker dies during the move;
3. stream each moving layer's parameters, buffers and optimizer state straight to its new stage (JSON metadata plus
   raw tensors, point-to-point; nothing pickled);
4. agree that every transfer arrived, then commit: senders drop the layers, receivers adopt them. A layer is never
   in two stages or in none.
Processes and the process group stay up; the pipeline pauses only for the transfer.
"""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path
from typing import Any

import cloudpickle
import torch

from vpipe_lab.control import protocol as P
from vpipe_lab.control.checkpoint import Manifest, complete, layer_file, sha256, sums_file, write_synced
from vpipe_lab.core.migration import match_layers, owners
from vpipe_lab.core.model import Plan, Policy
from vpipe_lab.core.partition import uniform
from vpipe_lab.runtime import faults
from vpipe_lab.runtime.capture import Chain, UnitTensors, build_model, capture, to_meta
from vpipe_lab.runtime.comm import TAG_MIGRATE
from vpipe_lab.runtime.memory import tensor_bytes
from vpipe_lab.runtime.stage import Stage
from vpipe_lab.runtime.units import get_tensor, set_tensor
from vpipe_lab.runtime.worker import Worker

log = logging.getLogger(__name__)


def flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """JSON-able structure with tensors replaced by references into ``tensors`` (dict keys keep their types)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
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
    """A layer's parameters and buffers by canonical name, their optimizer state, its optimizer groups' options (a
    learning rate a scheduler set travels with the layer) and its policy."""
    layer = stage.layers[index]
    names = list(dict.fromkeys(layer.names))
    return {"tensors": {name: stage.tensors[name].detach() for name in names},
            "optimizer": stage.optimizer_state(names), "groups": stage.unit_groups(index),
            "policy": layer.policy.value}


def renamed(state: dict[str, Any], old: UnitTensors, new: UnitTensors) -> dict[str, Any]:
    """A layer's state under the names its tensors have in a new model version (NAS shifts layer indices)."""
    names = {o: n for (_, o), (_, n) in zip(old.params + old.buffers, new.params + new.buffers)}
    return {**state, "tensors": {names[k]: v for k, v in state["tensors"].items()},
            "optimizer": {names[k]: v for k, v in state["optimizer"].items()},
            "groups": [{**g, "params": [names[n] for n in g["params"]]} for g in state.get("groups", [])]}


def materialise(unit: torch.nn.Module, tensors: UnitTensors, values: dict[str, torch.Tensor],
                device: torch.device) -> None:
    """Fill a shell unit's parameters and buffers with ``values`` (by canonical name), on ``device``."""
    for local, name in tensors.params:
        old = get_tensor(unit, local)
        set_tensor(unit, local, torch.nn.Parameter(values[name].to(device), requires_grad=old.requires_grad))
    for local, name in tensors.buffers:
        set_tensor(unit, local, values[name].to(device))


class _Skip(Exception):
    """A replica other than the first writes nothing."""


class MigratingWorker(Worker):
    """A stage worker that can change its plan, its layers and even its model between iterations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model_version = 0
        if self.spec.resume_path:
            self.restore(Path(self.spec.resume_path))

    # --- state on disk -------------------------------------------------------------------------------------------
    def restore(self, path: Path) -> None:
        manifest = Manifest.read(path)
        if manifest.num_layers != self.num_layers:
            raise ValueError(f"checkpoint {path} holds {manifest.num_layers} layers but the model has "
                             f"{self.num_layers}: resume with the model that was saved")
        states: dict[str, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        with torch.no_grad():
            for index in self.stage.owned:
                data = io.BytesIO(manifest.load_bytes(index))  # checked against its checksum
                state = torch.load(data, map_location=self.placement.device, weights_only=True)
                for name, value in state["tensors"].items():
                    self.stage.tensors[name].copy_(value)
                states.update(state["optimizer"])
                groups += state.get("groups", [])  # absent in checkpoints written before parameter groups
        self.stage.optim.load(states, groups, self.stage.tensors)
        self.scale.load(manifest.extra.get("loss_scale", {}))
        self.ctl.plan_version = manifest.plan_version
        self.model_version = manifest.model_version
        log.info("restored layers %s from %s at iteration %d", self.stage.owned, path, manifest.iteration)

    def save(self, root: Path, name: str | None = None, keep: int | None = None) -> str | None:
        """Every rank writes its layers (fsynced, with checksums) into a new version directory; then rank 0 writes the
        manifest and switches ``latest`` to it (see control/checkpoint.py): the previous version stays valid until
        then. A rank that cannot write (no space, no permission) does not stop training: all ranks agree the save
        failed and the reason (rank 0's view) is returned; None when it succeeded."""
        version = root / (name or f"ckpt-{self.ctl.iteration:08d}-{self.ctl.plan_version}-{self.model_version}")
        problem: str | None = None
        try:
            if self.replica > 0:  # the replicas hold the same state: the first one writes it, the others agree
                raise _Skip
            version.mkdir(parents=True, exist_ok=True)
            sums: dict[str, str] = {}
            for index in self.stage.owned:
                buffer = io.BytesIO()
                torch.save(layer_state(self.stage, index), buffer)
                target = layer_file(version, index)
                write_synced(target, buffer.getvalue())
                sums[target.name] = sha256(buffer.getvalue())
            write_synced(sums_file(version, self.rank), json.dumps(sums).encode())
        except _Skip:
            pass
        except OSError as exc:
            problem = f"stage {self.rank} cannot write {exc.filename or version}: {exc.strerror or exc}"
            log.error("save failed: %s", problem)
        faults.hit(faults.parse(), "save", self.rank, self.ctl.iteration)
        if self.peer.all_max([1.0 if problem else 0.0])[0] > 0:  # everyone learns; nothing is switched
            return problem or "another stage could not write its layers"
        if self.leader:
            try:
                complete(version, Manifest(self.ctl.iteration, self.plan.to_dict(), self.num_layers, self.names,
                                           self.spec.seed, self.ctl.plan_version, self.model_version,
                                           extra={"loss_scale": self.scale.state()}), self.world, keep)
            except OSError as exc:
                problem = f"stage 0 cannot complete the checkpoint in {version}: {exc.strerror or exc}"
        if self.peer.all_max([1.0 if problem else 0.0])[0] > 0:
            return problem or "stage 0 could not complete the checkpoint"
        return None

    # --- unattended runs (``vpipe-lab worker --run-dir DIR``) -----------------------------------------------------
    def after_iteration(self) -> None:
        super().after_iteration()
        every, run_dir = self.spec.save_every, self.spec.run_dir
        if every and run_dir and self.ctl.iteration % every == 0:
            self._save_run()

    def finish_unattended(self) -> None:
        run_dir = self.spec.run_dir
        if run_dir and not (self.spec.save_every and self.ctl.iteration % self.spec.save_every == 0):
            self._save_run()  # the last iterations are not lost to the next restart
        super().finish_unattended()

    def _save_run(self) -> None:
        assert self.spec.run_dir is not None
        problem = self.save(Path(self.spec.run_dir) / "checkpoints", keep=3)
        if problem is not None:  # training goes on; the next save may succeed (a full disk freed, say)
            log.error("the checkpoint at iteration %d failed: %s", self.ctl.iteration, problem)
        elif self.leader:
            log.info("checkpoint at iteration %d in %s", self.ctl.iteration, self.spec.run_dir)

    # --- commands ----------------------------------------------------------------------------------------------
    def handle_extra(self, cmd: dict[str, Any]) -> None:
        kind = cmd["type"]
        if kind == P.SAVE:
            problem = self.save(Path(cmd["path"]), cmd.get("name"), cmd.get("keep"))
            self.ack(cmd, path=cmd["path"], ok=problem is None, error=problem)
        elif kind == P.APPLY:
            plan = Plan.from_dict(cmd["plan"]).validate(self.num_layers, self.world)
            result = self.reconfigure(plan, {j: j for j in range(self.num_layers)}, None, cmd.get("checkpoint"),
                                      int(cmd.get("version", self.ctl.plan_version + 1)))
            self.ack(cmd, **result)
        elif kind == P.MODEL:
            with open(cmd["path"], "rb") as fh:  # written by the controller into the job directory, not a socket
                factory = cloudpickle.load(fh)
            if self.chain.graph:
                raise TypeError("set_model (NAS) swaps layers of an nn.Sequential model; this model was captured "
                                "from a general nn.Module, so relaunch with the new model instead")
            old_signatures = [signature(m) for m in self.chain.units]
            self.model_version += 1
            model = build_model(factory, self.spec.seed + 1_000_003 * self.model_version)
            if not isinstance(model, torch.nn.Sequential):
                raise TypeError(f"the new model factory returned {type(model).__name__}, not an nn.Sequential")
            if len(model) < self.world:
                raise ValueError(f"the new model has {len(model)} layers, fewer than the {self.world} stages")
            new_chain = capture(model, None, None)
            # Every rank computes the same defaults: layers matched by signature, an even split, policies carried.
            if cmd.get("mapping") is not None:
                sources = {int(j): (None if i is None else int(i)) for j, i in cmd["mapping"].items()}
            else:
                sources = match_layers(old_signatures, [signature(m) for m in model])
            if cmd.get("plan") is not None:
                plan = Plan.from_dict(cmd["plan"]).validate(len(model), self.world)
            else:
                policies = [self.plan.policies[i] if i is not None else Policy.KEEP for _, i in sorted(sources.items())]
                plan = Plan(uniform(len(model), self.world), tuple(policies), self.plan.microbatches,
                            self.plan.schedule)
            result = self.reconfigure(plan, sources, new_chain, cmd.get("checkpoint"),
                                      int(cmd.get("version", self.ctl.plan_version + 1)))
            if result["ok"]:
                self.model_fn = factory
            self.ack(cmd, names=self.names, plan=self.plan.to_dict(),
                     mapping={str(j): i for j, i in sources.items()}, **result)
        else:
            super().handle_extra(cmd)

    # --- the reconfiguration itself --------------------------------------------------------------------------------
    def reconfigure(self, plan: Plan, sources: dict[int, int | None], new_chain: Chain | None,
                    checkpoint: str | None, version: int) -> dict[str, Any]:
        """Move to ``plan``; new layer j takes old layer ``sources[j]``'s state (None: fresh from ``new_chain``)."""
        start = time.perf_counter()
        rank, stage = self.rank, self.stage
        old_owner, new_owner = owners(self.plan.boundaries), owners(plan.boundaries)
        sends = [(j, i, new_owner[j]) for j, i in sorted(sources.items())
                 if i is not None and old_owner[i] == rank and new_owner[j] != rank]
        recvs = [(j, i, old_owner[i]) for j, i in sorted(sources.items())
                 if i is not None and new_owner[j] == rank and old_owner[i] != rank]
        stays = [(j, i) for j, i in sorted(sources.items())
                 if i is not None and old_owner[i] == rank and new_owner[j] == rank]
        fresh = [j for j, i in sorted(sources.items()) if i is None and new_owner[j] == rank]
        problem = self.ties.conflict(plan, new_chain)  # every rank finds the same answer: nothing moves
        if self.chain.graph and plan.microbatches != self.plan.microbatches:
            problem = (f"the model was captured for {self.plan.microbatches} micro-batches (its graph is specialised "
                       "to their shapes); relaunch to change the number of micro-batches")
        if problem is not None:
            return {"ok": False, "error": problem, "pause_s": time.perf_counter() - start}

        # 1. Memory: everyone learns what comes to whom, receivers check their budgets, all agree.
        def static(index: int) -> int:
            state = layer_state(stage, index)
            return (2 * sum(tensor_bytes(t) for t in state["tensors"].values())
                    + sum(tensor_bytes(v) for st in state["optimizer"].values() for v in st.values()
                          if isinstance(v, torch.Tensor)))

        incoming = [0.0] * self.world
        for _, i, dst in sends:
            incoming[dst] += static(i)
        incoming = [v / self.replicas for v in self.peer.all_sum(incoming)]  # each replica added the same
        outgoing = sum(static(i) for _, i, _ in sends)
        after = sum(stage.static_bytes().values()) - outgoing + int(incoming[rank])
        budget = self.executor.budget
        refuse = budget is not None and after > budget
        # The verdict carries who refused and by how much, so rank 0's acknowledgement says it (a separate message
        # from the refusing stage could arrive after the acknowledgement).
        verdict = self.peer.all_max([1.0, float(rank), float(after), float(budget or 0)] if refuse else [0.0, -1.0, 0.0,
                                                                                                       0.0])
        if verdict[0] > 0:
            if refuse:
                self.send(P.ERROR, {"kind": "migration", "stage": rank, "needed": after, "budget": budget,
                                    "incoming": int(incoming[rank]), "version": version})
            return {"ok": False, "error": "a receiving stage lacks memory for the incoming layers; nothing moved",
                    "refused": {"stage": int(verdict[1]), "needed": int(verdict[2]), "budget": int(verdict[3])},
                    "pause_s": time.perf_counter() - start}
        # 2. The state to fall back on if a worker dies during the move.
        # Every rank takes part in the same collectives: whether anything moves anywhere is agreed by all of them
        # (a rank with nothing to move must still join the checkpoint's collectives).
        if checkpoint and self.peer.all_max([float(bool(sends or recvs))])[0] > 0:
            problem = self.save(Path(checkpoint))
            if problem is not None:  # every rank got the same verdict: move nothing without the safety net
                return {"ok": False, "error": f"the checkpoint before the migration failed ({problem}); nothing "
                                              "moved (apply(plan, checkpoint=False) moves without one)",
                        "pause_s": time.perf_counter() - start}
        saved_at = time.perf_counter()
        fault = faults.parse()
        # 3. Transfers: sends are asynchronous, receives in the senders' order (ascending layer index per pair).
        moved = 0
        for j, i, dst in sends:
            tensors: list[torch.Tensor] = []
            state = layer_state(stage, i)
            if new_chain is not None:
                state = renamed(state, stage.layers[i].tensors, new_chain.tensors[j])
            meta = flatten(state, tensors)
            self.peer.send_json({"layer": j, "meta": meta, "count": len(tensors)}, dst, TAG_MIGRATE)
            for t in tensors:
                self.peer.send(t, dst, TAG_MIGRATE)
                moved += t.numel() * t.element_size()
            faults.hit(fault, "migrate", rank, self.ctl.iteration)
        arrived: dict[int, dict[str, Any]] = {}
        for j, _, src in recvs:
            head = self.peer.recv_json(src, TAG_MIGRATE)
            if head["layer"] != j:
                raise RuntimeError(f"migration out of order: expected layer {j} from rank {src}, got {head['layer']}")
            tensors = [self.peer.recv(src, TAG_MIGRATE)[0] for _ in range(head["count"])]
            arrived[j] = unflatten(head["meta"], tensors)
            faults.hit(fault, "migrate", rank, self.ctl.iteration)  # a receiver dying with a layer half-adopted
        self.peer.flush()
        # 4. Commit only once every rank has everything it needs. Layers that stay keep their modules; arriving
        # ones fill the chain's shells (a new model's chain brings its own fresh layers); a tie arriving where its
        # weight is already held binds to that one tensor.
        self.peer.barrier()
        chain = new_chain if new_chain is not None else self.chain
        kept = {j: stage.layers[i] for j, i in stays}
        # What stays keeps its optimizer state and groups by name across taking the layers apart and back together.
        held = {j: layer_state(stage, i) for j, i in stays}
        if new_chain is not None:  # kept layers' tensors take their names in the new model
            held = {j: renamed(held[j], stage.layers[i].tensors, new_chain.tensors[j]) for j, i in stays}
        for index in list(stage.owned):
            layer = stage.remove_layer(index)
            if not any(layer is k for k in kept.values()):
                to_meta(layer.module, layer.tensors)
        for j, layer in sorted(kept.items()):
            if new_chain is not None:  # a kept layer takes its place (and its tensors' names) in the new model
                new_chain.units[j] = layer.module
            stage.add_layer(j, layer.module, chain.tensors[j], held[j]["groups"], held[j]["optimizer"])
        for j, state in arrived.items():
            materialise(chain.units[j], chain.tensors[j], state["tensors"], self.placement.device)
            stage.add_layer(j, chain.units[j], chain.tensors[j], state.get("groups"), state["optimizer"])
        for j in fresh:
            stage.add_layer(j, chain.units[j], chain.tensors[j])
        stage.layers = dict(sorted(stage.layers.items()))
        stage.set_policies({j: plan.policies[j] for j in stage.owned})
        stage.reset_stats()
        self.profile_soon()
        if new_chain is not None:
            for j, unit in enumerate(new_chain.units):
                if j not in stage.layers:
                    to_meta(unit, new_chain.tensors[j])
            self.chain = self.executor.chain = new_chain
            self.num_layers, self.names = len(new_chain), list(new_chain.names)
        self.plan = plan
        self.ties.refresh()
        self.ctl.plan_version = version
        pause = time.perf_counter() - start
        now = self.clock.now()
        if self.replica == 0:  # the other replicas moved the same layers at the same boundary
            self.send(P.MIGRATED, {"id": None, "rank": rank, "version": version, "moved_bytes": moved,
                                   "pause_s": pause, "transfer_s": time.perf_counter() - saved_at,
                                   "layers_in": [j for j, _, _ in recvs], "layers_out": [j for j, _, _ in sends],
                                   "span": [now - pause, now], "iteration": self.ctl.iteration})
        if self.leader:  # an attached client learns the plan in force from this (see control/broker.py)
            self.send(P.CURRENT, {"plan": plan.to_dict(), "plan_version": version, "names": self.names})
        total = self.peer.all_sum([float(moved), pause])
        return {"ok": True, "moved_bytes": int(total[0]), "pause_s": pause, "version": version,
                "layers": self.num_layers}
