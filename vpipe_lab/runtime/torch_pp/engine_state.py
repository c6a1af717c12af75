"""The torch engine's answers about its state: checkpoints (DCP, as the lab's engine writes them), the reshard a plan
change is, the model's tensors, and a profile apportioned from each stage's measured times (mixed into
``runtime/torch_pp/engine.TorchWorker``, whose docstring says why a plan change is a reshard here)."""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import LayerCost
from vpipe_lab.runtime.disk import dcp_state
from vpipe_lab.runtime.disk.checkpoints import check_files, write_version
from vpipe_lab.runtime.model.callables import agreed_plan, job_dir
from vpipe_lab.wire import commands as C
from vpipe_lab.wire import events as E
from vpipe_lab.wire.checkpoint import Manifest, is_foreign, resolve
from vpipe_lab.wire.tensors import encode

log = logging.getLogger("vpipe_lab.torch_engine")


class TorchState:
    """Checkpoints, reshards, tensors and profiles of a ``TorchWorker`` (which holds the attributes named here)."""

    spec: Any
    peer: Any
    place: Any
    index: int
    world: int
    leader: bool
    ctl: Any
    plan: Plan
    chain: Any
    names: list[str]
    num_layers: int
    model_version: int
    pp: Any
    named: dict[str, torch.nn.Parameter]
    optimizer: Any
    scheduler: Any
    placement: Any
    record_spans: bool
    stats: dict[int, dict[str, list[float]]]
    _unit_of: dict[str, int]

    ack: Any
    send: Any
    current: Any
    _build: Any

    # --- checkpoints ----------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """This rank's part of the job as a DCP state dict: its tensors under the model's own ``state_dict()`` names,
        its optimizer flattened by parameter name, the step (``runtime/disk/dcp_state.py``'s layout)."""
        optimizer = dcp_state.flatten_optimizer(self.named, self.optimizer) if self.optimizer is not None else {}
        return {**self.pp.tensors(), dcp_state.OPTIMIZER: optimizer,  # a sharded stage's: DCP writes its shards
                dcp_state.TRAIN: {"step": torch.tensor(self.ctl.iteration, dtype=torch.int64)}}

    def save(self, root: Path, name: str | None = None, keep: int | None = None) -> str | None:
        """A new checkpoint version under ``root``, as ``session.save`` describes it; None, or why it failed."""
        version = root / (name or f"ckpt-{self.ctl.iteration:08d}-{self.ctl.plan_version}-{self.model_version}")
        place = self.place  # the first replica's every shard writes: writer shard x stages + stage, its global rank
        state = self.state() if place.replica == 0 else {}
        return write_version(self.peer, place.shard * self.world + self.index, self.world * place.shards,
                             place.replica, self.leader, version, state, lambda: Manifest(
            self.ctl.iteration, self.plan.to_dict(), self.num_layers, self.names, self.spec.settings.seed,
            self.ctl.plan_version,
            self.model_version, format="dcp", units=self.chain.infos(),
            extra={"microbatch_size": self.samples // self.plan.microbatches if self.samples else None}),
            keep, self.ctl.iteration)

    def load(self, path: Path) -> None:
        """Read this rank's tensors and optimizer state by name from a DCP checkpoint (the lab's or torch's)."""
        listed: set[str] | None = None  # torch's own checkpoint: plain file names inside it
        if not is_foreign(path):
            manifest = Manifest.read(path)
            if manifest.format != "dcp":
                raise ValueError(f"checkpoint {path} is in the per-layer format of earlier releases: resume it with "
                                 "engine='lab' and save it again (as a DCP checkpoint) to use it here")
            check_files(self.peer, self.place.shard * self.world + self.index, self.world * self.place.shards,
                        self.place.replica, manifest)
            listed = set(manifest.files)
        reader = dcp_state.SafeReader(str(resolve(path)), listed)
        wanted = [([key], tensor) for key, tensor in self.pp.tensors().items()]  # read in place (DTensors: a slice)
        template, missing = dcp_state.template(wanted, set(self.named), reader.read_metadata(), self.named)
        if missing:
            raise ValueError(f"checkpoint {path} has no {', '.join(missing[:3])}: it was saved from another model")
        with torch.no_grad():
            dcp.load(template, storage_reader=reader, planner=dcp_state.SafeLoadPlanner(), no_dist=True)
        if self.optimizer is not None:
            dcp_state.load_optimizer(self.named, self.optimizer, template.get(dcp_state.OPTIMIZER) or {},
                                     self.placement.device)
            self._continue_schedule()

    def _continue_schedule(self) -> None:
        """A scheduler built for restored groups goes on at this iteration from each group's restored rate."""
        if self.scheduler is None or self.ctl.iteration == 0:
            return
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.scheduler.last_epoch = self.ctl.iteration
        self.scheduler._step_count = self.ctl.iteration + 1
        self.scheduler._last_lr = list(lrs)

    # --- a plan change: a reshard -------------------------------------------------------------------------------
    def _apply_plan(self, cmd: C.Apply) -> None:
        """Save, rebuild the new plan's stages from a fresh model, load them back by name (every rank at once)."""
        plan = agreed_plan(cmd.plan, cmd.schedules, self.num_layers, self.world, self.peer.all_max, job_dir(self.spec))
        if isinstance(plan, str):
            return self.ack(cmd, ok=False, error=plan)
        version = cmd.version if cmd.version is not None else self.ctl.plan_version + 1
        start = time.perf_counter()
        shared = Path(tempfile.gettempdir()) / f"vpipe-torch-{self.spec.session_id}-reshard-v{version}"
        root = Path(cmd.checkpoint) if cmd.checkpoint else shared  # the apply's own checkpoint doubles as the snapshot
        problem = self.save(root)
        if problem is not None:
            return self.ack(cmd, ok=False, error=f"the snapshot before the reshard failed ({problem}); nothing changed")
        before = {n: self.plan.stage_of(u) for n, u in self._unit_of.items() if u >= 0}
        self.plan, self.ctl.plan_version = plan, version
        self._build(plan)
        self.load(root)
        moved = sum(p.numel() * p.element_size() for n, p in self.named.items()
                    if self._unit_of.get(n, -1) >= 0 and before.get(n, self.index) != self.index)
        moved = int(self.peer.all_sum([float(moved)])[0])
        if not cmd.checkpoint:
            self.peer.barrier()
            if self.leader:
                shutil.rmtree(shared, ignore_errors=True)
        self.stats.clear()
        self.current()
        self.ack(cmd, ok=True, moved_bytes=moved, pause_s=time.perf_counter() - start)

    def _set_model(self, cmd: C.SetModel) -> None:
        self.ack(cmd, ok=False, error="engine='torch' trains one model: switching models (set_model) needs the lab's "
                                      "engine")

    # --- what the controller asks ---------------------------------------------------------------------------------
    def _state(self, cmd: C.State) -> None:
        if self.place.dp != 0 and self.place.shards == 1:
            return  # the replicas hold the first one's state; a sharded stage's shards gather it together
        place = {key: i for i, key in enumerate(self.chain.state_keys)}
        meta, buffers = [], []
        for key, tensor in self.pp.state_dict().items():
            m, b = encode(key, tensor)
            m.aliases = [(key, place.get(key, len(place)))]
            meta.append(m)
            buffers.append(b)
        if self.place.dp == 0:
            self.send(E.Tensors(cmd.id, self.index, meta, buffers))

    def _telemetry(self, cmd: C.Telemetry) -> None:
        self.record_spans = cmd.spans
        self.ack(cmd)

    def _evaluate(self, cmd: C.Evaluate) -> None:
        if self.leader:
            self.send(E.Evaluated(self.index, cmd.id, self.ctl.iteration,
                                  error="evaluation passes run on the lab's engine (engine='lab')"))

    def _profile(self, cmd: C.Profile) -> None:
        """Each unit's costs here: its stage's median forward, backward and weight-step times and its activations,
        spread over the stage's units by their parameter bytes (torch times stages, not layers); parameters and
        optimizer state exact."""
        layers = []
        if self.place.dp != 0:  # every data-parallel pipeline measures the same layers; the first one answers
            return
        for spec in self.pp.bundle.stages_of(self.index):
            times = self.stats.get(spec.stage, {})
            units = list(spec.units)
            own = {u: [p for n, p in self.named.items() if self._unit_of.get(n) == u] for u in units}
            size = {u: sum(p.numel() * p.element_size() for p in own[u]) for u in units}
            total = sum(size.values())
            for u in units:
                share = size[u] / total if total else 1 / len(units)
                optim = sum(v.numel() * v.element_size() for p in own[u] for v in
                            (self.optimizer.state.get(p, {}).values() if self.optimizer else ())
                            if isinstance(v, torch.Tensor))
                f, b, w = (statistics.median(times[k]) if times.get(k) else 0.0 for k in ("F", "B", "W"))
                cost = LayerCost(self.names[u], f * share, (b + w) * share,
                                 int(self.activations_per_mb(spec.stage) * share), 0, 0, size[u], optim, (),
                                 w * share if w else None)
                layers.append(E.LayerMeasure(u, cost, len(times.get("F", []))))
        self.send(E.Layers(cmd.id, self.index, layers))
        if cmd.reset:
            self.stats.clear()

    def activations_per_mb(self, stage: int) -> float:
        """What one micro-batch of ``stage`` saves for backward: the rank's measured peak over the most micro-batches
        it held at once, shared among its stages."""
        held = self.stats.get(stage, {}).get("held", [])
        peak = self.stats.get(-1, {}).get("peak", [0.0])
        return max(peak) / max(1.0, max(held, default=1.0)) / max(1, len(self.pp.bundle.stages_of(self.index)))
