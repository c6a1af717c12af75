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

import logging
import os
import time
from pathlib import Path
from typing import Any

import cloudpickle
import torch

from vpipe_lab.control import protocol as P
from vpipe_lab.control.checkpoint import Manifest, layer_file
from vpipe_lab.core.migration import match_layers, owners
from vpipe_lab.core.model import Plan, Policy
from vpipe_lab.core.partition import uniform
from vpipe_lab.runtime.comm import TAG_MIGRATE
from vpipe_lab.runtime.memory import module_param_bytes, optimizer_bytes
from vpipe_lab.runtime.stage import Layer
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


def layer_state(layer: Layer) -> dict[str, Any]:
    return {"module": layer.module.state_dict(), "optimizer": layer.optimizer.state_dict() if layer.optimizer else None,
            "policy": layer.policy.value}


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
        for index in self.stage.owned:
            state = torch.load(layer_file(path, index), map_location=self.placement.device, weights_only=True)
            self.stage.layers[index].module.load_state_dict(state["module"])
            if state["optimizer"] is not None and self.stage.layers[index].optimizer is not None:
                self.stage.layers[index].optimizer.load_state_dict(state["optimizer"])
        self.ctl.plan_version = manifest.plan_version
        self.model_version = manifest.model_version
        log.info("restored layers %s from %s at iteration %d", self.stage.owned, path, manifest.iteration)

    def save(self, path: Path) -> None:
        """Every rank writes its layers; then rank 0 writes the manifest that makes the checkpoint complete."""
        path.mkdir(parents=True, exist_ok=True)
        for index in self.stage.owned:
            torch.save(layer_state(self.stage.layers[index]), layer_file(path, index))
        self.peer.barrier()
        if self.rank == 0:
            Manifest(self.ctl.iteration, self.plan.to_dict(), self.num_layers, self.names, self.spec.seed,
                     self.ctl.plan_version, self.model_version).write(path)

    # --- commands ----------------------------------------------------------------------------------------------
    def handle_extra(self, cmd: dict[str, Any]) -> None:
        kind = cmd["type"]
        if kind == P.SAVE:
            self.save(Path(cmd["path"]))
            self.ack(cmd, path=cmd["path"])
        elif kind == P.APPLY:
            plan = Plan.from_dict(cmd["plan"]).validate(self.num_layers, self.world)
            result = self.reconfigure(plan, {j: j for j in range(self.num_layers)}, None, cmd.get("checkpoint"),
                                      int(cmd.get("version", self.ctl.plan_version + 1)))
            self.ack(cmd, **result)
        elif kind == P.MODEL:
            with open(cmd["path"], "rb") as fh:  # written by the controller into the job directory, not a socket
                factory = cloudpickle.load(fh)
            old_signatures = [signature(m) for m in self._template()]
            self.model_version += 1
            torch.manual_seed(self.spec.seed + 1_000_003 * self.model_version)
            model = factory()
            if not isinstance(model, torch.nn.Sequential):
                raise TypeError(f"the new model factory returned {type(model).__name__}, not an nn.Sequential")
            if len(model) < self.world:
                raise ValueError(f"the new model has {len(model)} layers, fewer than the {self.world} stages")
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
            result = self.reconfigure(plan, sources, model, cmd.get("checkpoint"),
                                      int(cmd.get("version", self.ctl.plan_version + 1)))
            if result["ok"]:
                self.model_fn = factory
                self.num_layers = len(model)
                self.names = [f"{i}:{type(m).__name__}" for i, m in enumerate(model)]
            self.ack(cmd, names=self.names, plan=self.plan.to_dict(),
                     mapping={str(j): i for j, i in sources.items()}, **result)
        else:
            super().handle_extra(cmd)

    # --- the reconfiguration itself --------------------------------------------------------------------------------
    def reconfigure(self, plan: Plan, sources: dict[int, int | None], new_model: torch.nn.Sequential | None,
                    checkpoint: str | None, version: int) -> dict[str, Any]:
        """Move to ``plan``; new layer j takes old layer ``sources[j]``'s state (None: fresh from ``new_model``)."""
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

        # 1. Memory: everyone learns what comes to whom, receivers check their budgets, all agree.
        def static(index: int) -> int:
            layer = stage.layers[index]
            return 2 * module_param_bytes(layer.module) + optimizer_bytes(layer.optimizer)

        incoming = [0.0] * self.world
        for _, i, dst in sends:
            incoming[dst] += static(i)
        incoming = self.peer.all_sum(incoming)
        outgoing = sum(static(i) for _, i, _ in sends)
        after = sum(stage.static_bytes().values()) - outgoing + int(incoming[rank])
        budget = self.executor.budget
        refuse = budget is not None and after > budget
        if self.peer.all_max([1.0 if refuse else 0.0])[0] > 0:
            if refuse:
                self.send(P.ERROR, {"kind": "migration", "stage": rank, "needed": after, "budget": budget,
                                    "incoming": int(incoming[rank]), "version": version})
            return {"ok": False, "error": "a receiving stage lacks memory for the incoming layers; nothing moved",
                    "pause_s": time.perf_counter() - start}
        # 2. The state to fall back on if a worker dies during the move.
        if checkpoint and (sends or recvs or self.peer.all_max([float(bool(sends or recvs))])[0] > 0):
            self.save(Path(checkpoint))
        saved_at = time.perf_counter()
        fault = os.environ.get("VPIPE_LAB_FAULT", "")
        # 3. Transfers: sends are asynchronous, receives in the senders' order (ascending layer index per pair).
        moved = 0
        for j, i, dst in sends:
            tensors: list[torch.Tensor] = []
            meta = flatten(layer_state(stage.layers[i]), tensors)
            self.peer.send_json({"layer": j, "meta": meta, "count": len(tensors)}, dst, TAG_MIGRATE)
            for t in tensors:
                self.peer.send(t, dst, TAG_MIGRATE)
                moved += t.numel() * t.element_size()
            if fault == f"migrate:{rank}":
                log.error("fault injection: dying in the middle of a migration")
                os._exit(17)
        arrived: dict[int, dict[str, Any]] = {}
        for j, _, src in recvs:
            head = self.peer.recv_json(src, TAG_MIGRATE)
            if head["layer"] != j:
                raise RuntimeError(f"migration out of order: expected layer {j} from rank {src}, got {head['layer']}")
            tensors = [self.peer.recv(src, TAG_MIGRATE)[0] for _ in range(head["count"])]
            arrived[j] = unflatten(head["meta"], tensors)
        self.peer.flush()
        # 4. Commit only once every rank has everything it needs.
        self.peer.barrier()
        template = new_model if new_model is not None else (self._shells() if arrived else None)
        # Layers that move or stay keep their modules and optimizers; a new model only supplies fresh layers and
        # the shells that arriving state is loaded into.
        layers: dict[int, Layer] = {}
        for j, i in stays:
            layer = stage.layers[i]
            layer.index = j
            layers[j] = layer
        stage.layers = {}
        for j, state in arrived.items():
            assert template is not None
            module = template[j]
            if any(p.is_meta for p in module.parameters()) or any(b.is_meta for b in module.buffers()):
                module = module.to_empty(device=self.placement.device)
            module.load_state_dict(state["module"])
            stage.add_layer(j, module, state["optimizer"])
            layers[j] = stage.layers[j]
        for j in fresh:
            assert new_model is not None
            stage.add_layer(j, new_model[j])
            layers[j] = stage.layers[j]
        stage.layers = dict(sorted(layers.items()))
        stage._refresh_params()
        stage._kept_bytes.clear()
        stage.set_policies({j: plan.policies[j] for j in stage.owned})
        stage.reset_stats()
        self.plan = plan
        self.ctl.plan_version = version
        pause = time.perf_counter() - start
        now = self.clock.now()
        self.send(P.MIGRATED, {"id": None, "rank": rank, "version": version, "moved_bytes": moved,
                               "pause_s": pause, "transfer_s": time.perf_counter() - saved_at,
                               "layers_in": [j for j, _, _ in recvs], "layers_out": [j for j, _, _ in sends],
                               "span": [now - pause, now], "iteration": self.ctl.iteration})
        if rank == 0:  # an attached client learns the plan in force from this (see control/broker.py)
            self.send(P.CURRENT, {"plan": plan.to_dict(), "plan_version": version,
                                  "names": self.names if new_model is None else
                                  [f"{i}:{type(m).__name__}" for i, m in enumerate(new_model)]})
        total = self.peer.all_sum([float(moved), pause])
        return {"ok": True, "moved_bytes": int(total[0]), "pause_s": pause, "version": version,
                "layers": self.num_layers if new_model is None else len(new_model)}

    def _template(self) -> torch.nn.Sequential:
        """A fresh instance of the current model."""
        torch.manual_seed(self.spec.seed + 1_000_003 * self.model_version)
        return self.model_fn()

    def _shells(self) -> torch.nn.Sequential:
        """Layers to load migrated state into, built on the meta device: no memory and no initialisation, which for
        wide layers costs more than the transfer itself. A model whose layers hold buffers outside their state_dict
        (non-persistent ones) would come out uninitialised there, so it is built for real instead."""
        try:
            with torch.device("meta"):
                shells = self.model_fn()
        except Exception:  # a factory that cannot build on meta (data-dependent init, say)
            return self._template()
        for module in shells:
            names = set(module.state_dict())
            if any(name not in names for name, _ in module.named_buffers()):
                return self._template()
        return shells
