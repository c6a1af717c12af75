"""The torch engine's answers about its state: checkpoints (DCP, as the lab's engine writes them), the reshard a plan
change is, the model's tensors, and a profile apportioned from each stage's measured times (``TorchState``, a
collaborator of ``runtime/torch_pp/engine.TorchWorker``, whose docstring says why a plan change is a reshard here)."""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import LayerCost
from vpipe_lab.runtime.disk import dcp_state
from vpipe_lab.runtime.disk.checkpoints import check_files, write_version
from vpipe_lab.runtime.engine.device import Placement
from vpipe_lab.runtime.model.callables import agreed_plan, job_dir
from vpipe_lab.runtime.torch_pp.pipeline import TorchPipeline
from vpipe_lab.runtime.worker_commands import RankHost, Replies
from vpipe_lab.wire import commands as C
from vpipe_lab.wire import events as E
from vpipe_lab.wire.checkpoint_format import Manifest, is_foreign, resolve
from vpipe_lab.wire.tensors import encode

log = logging.getLogger("vpipe_lab.torch_engine")


class TorchHost(RankHost, Protocol):
    """What ``TorchState`` reads of its ``TorchWorker``: beside a rank's (``worker_commands.RankHost``), the stages
    the plan in force built (replaced at every reshard, so read when asked)."""

    samples: int
    pp: TorchPipeline
    named: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    scheduler: Any  # the user's LR scheduler (torch's LRScheduler or their own), or None
    placement: Placement
    record_spans: bool
    stats: dict[int, dict[str, list[float]]]
    unit_of: dict[str, int]
    replies: Replies  # acknowledgements and the job as it is now (rank 0's to send)

    def build(self, plan: Plan) -> None:
        """Build this rank's stages of ``plan`` from a fresh model, with a new optimizer and scheduler."""


class TorchState:
    """Checkpoints, reshards, tensors and profiles of one ``TorchWorker`` (its ``host``)."""

    def __init__(self, host: TorchHost) -> None:
        self.host = host

    # --- checkpoints ----------------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """This rank's part of the job as a DCP state dict: its tensors under the model's own ``state_dict()`` names,
        its optimizer flattened by parameter name, the step (``runtime/disk/dcp_state.py``'s layout)."""
        h = self.host
        optimizer = dcp_state.flatten_optimizer(h.named, h.optimizer) if h.optimizer is not None else {}
        return {**h.pp.tensors(), dcp_state.OPTIMIZER: optimizer,  # a sharded stage's: DCP writes its shards
                dcp_state.TRAIN: {"step": torch.tensor(h.ctl.iteration, dtype=torch.int64)}}

    def save(self, root: Path, name: str | None = None, keep: int | None = None) -> str | None:
        """A new checkpoint version under ``root``, as ``session.save`` describes it; None, or why it failed."""
        h = self.host
        version = root / (name or f"ckpt-{h.ctl.iteration:08d}-{h.ctl.plan_version}-{h.model_version}")
        place = h.place  # the first replica's every shard writes: writer shard x stages + stage, its global rank
        state = self.state() if place.replica == 0 else {}
        return write_version(h.peer, place.shard * h.world + h.index, h.world * place.shards, place.replica, h.leader,
                             version, state, lambda: Manifest(
            h.ctl.iteration, h.plan.to_dict(), h.num_layers, h.names, h.spec.settings.seed, h.ctl.plan_version,
            h.model_version, format="dcp", units=h.chain.infos(),
            extra={"microbatch_size": h.samples // h.plan.microbatches if h.samples else None}), keep, h.ctl.iteration)

    def load(self, path: Path) -> None:
        """Read this rank's tensors and optimizer state by name from a DCP checkpoint (the lab's or torch's)."""
        h = self.host
        listed: set[str] | None = None  # torch's own checkpoint: plain file names inside it
        if not is_foreign(path):
            manifest = Manifest.read(path)
            if manifest.format != "dcp":
                raise ValueError(f"checkpoint {path} is in the per-layer format of earlier releases: resume it with "
                                 "engine='lab' and save it again (as a DCP checkpoint) to use it here")
            check_files(h.peer, h.place.shard * h.world + h.index, h.world * h.place.shards,
                        h.place.replica, manifest)
            listed = set(manifest.files)
        reader = dcp_state.SafeReader(str(resolve(path)), listed)
        wanted = [([key], tensor) for key, tensor in h.pp.tensors().items()]  # read in place (DTensors: a slice)
        template, missing = dcp_state.template(wanted, set(h.named), reader.read_metadata(), h.named)
        if missing:
            raise ValueError(f"checkpoint {path} has no {', '.join(missing[:3])}: it was saved from another model")
        with torch.no_grad():
            dcp.load(template, storage_reader=reader, planner=dcp_state.SafeLoadPlanner(), no_dist=True)
        if h.optimizer is not None:
            dcp_state.load_optimizer(h.named, h.optimizer, template.get(dcp_state.OPTIMIZER) or {},
                                     h.placement.device)
            self._continue_schedule()

    def _continue_schedule(self) -> None:
        """A scheduler built for restored groups goes on at this iteration from each group's restored rate."""
        h = self.host
        if h.scheduler is None or h.optimizer is None or h.ctl.iteration == 0:
            return
        lrs = [g["lr"] for g in h.optimizer.param_groups]
        h.scheduler.last_epoch = h.ctl.iteration
        h.scheduler._step_count = h.ctl.iteration + 1
        h.scheduler._last_lr = list(lrs)

    # --- a plan change: a reshard -------------------------------------------------------------------------------
    def apply_plan(self, cmd: C.Apply) -> None:
        """Save, rebuild the new plan's stages from a fresh model, load them back by name (every rank at once)."""
        h = self.host
        plan = agreed_plan(cmd.plan, cmd.schedules, h.num_layers, h.world, h.peer.all_max, job_dir(h.spec))
        if isinstance(plan, str):
            return h.replies.ack(cmd, ok=False, error=plan)
        version = cmd.version if cmd.version is not None else h.ctl.plan_version + 1
        start = time.perf_counter()
        shared = Path(tempfile.gettempdir()) / f"vpipe-torch-{h.spec.session_id}-reshard-v{version}"
        root = Path(cmd.checkpoint) if cmd.checkpoint else shared  # the apply's own checkpoint doubles as the snapshot
        problem = self.save(root)
        if problem is not None:
            return h.replies.ack(cmd, ok=False, error=f"the snapshot before the reshard failed ({problem}); nothing changed")
        before = {n: h.plan.stage_of(u) for n, u in h.unit_of.items() if u >= 0}
        h.plan, h.ctl.plan_version = plan, version
        h.build(plan)
        self.load(root)
        moved = sum(p.numel() * p.element_size() for n, p in h.named.items()
                    if h.unit_of.get(n, -1) >= 0 and before.get(n, h.index) != h.index)
        moved = int(h.peer.all_sum([float(moved)])[0])
        if not cmd.checkpoint:
            h.peer.barrier()
            if h.leader:
                shutil.rmtree(shared, ignore_errors=True)
        h.stats.clear()
        h.replies.current()
        h.replies.ack(cmd, ok=True, moved_bytes=moved, pause_s=time.perf_counter() - start)

    def set_model(self, cmd: C.SetModel) -> None:
        self.host.replies.ack(cmd, ok=False, error="engine='torch' trains one model: switching models (set_model) needs the "
                                           "lab's engine")

    # --- what the controller asks ---------------------------------------------------------------------------------
    def answer_state(self, cmd: C.State) -> None:
        h = self.host
        if h.place.dp != 0 and h.place.shards == 1:
            return  # the replicas hold the first one's state; a sharded stage's shards gather it together
        place = {key: i for i, key in enumerate(h.chain.state_keys)}
        meta, buffers = [], []
        for key, tensor in h.pp.state_dict().items():
            m, b = encode(key, tensor)
            m.aliases = [(key, place.get(key, len(place)))]
            meta.append(m)
            buffers.append(b)
        if h.place.dp == 0:
            h.send(E.Tensors(cmd.id, h.index, meta, buffers))

    def telemetry(self, cmd: C.Telemetry) -> None:
        self.host.record_spans = cmd.spans
        self.host.replies.ack(cmd)

    def evaluate(self, cmd: C.Evaluate) -> None:
        h = self.host
        if h.leader:
            h.send(E.Evaluated(h.index, cmd.id, h.ctl.iteration,
                               error="evaluation passes run on the lab's engine (engine='lab')"))

    def profile(self, cmd: C.Profile) -> None:
        """Each unit's costs here: its stage's median forward, backward and weight-step times and its activations,
        spread over the stage's units by their parameter bytes (torch times stages, not layers); parameters and
        optimizer state exact."""
        h = self.host
        layers = []
        if h.place.dp != 0:  # every data-parallel pipeline measures the same layers; the first one answers
            return
        for spec in h.pp.bundle.stages_of(h.index):
            times = h.stats.get(spec.stage, {})
            units = list(spec.units)
            own = {u: [p for n, p in h.named.items() if h.unit_of.get(n) == u] for u in units}
            size = {u: sum(p.numel() * p.element_size() for p in own[u]) for u in units}
            total = sum(size.values())
            for u in units:
                share = size[u] / total if total else 1 / len(units)
                optim = sum(v.numel() * v.element_size() for p in own[u] for v in
                            (h.optimizer.state.get(p, {}).values() if h.optimizer else ())
                            if isinstance(v, torch.Tensor))
                f, b, w = (statistics.median(times[k]) if times.get(k) else 0.0 for k in ("F", "B", "W"))
                cost = LayerCost(h.names[u], f * share, (b + w) * share,
                                 int(self.activations_per_mb(spec.stage) * share), 0, 0, size[u], optim, (),
                                 w * share if w else None)
                layers.append(E.LayerMeasure(u, cost, len(times.get("F", []))))
        h.send(E.Layers(cmd.id, h.index, layers))
        if cmd.reset:
            h.stats.clear()

    def activations_per_mb(self, stage: int) -> float:
        """What one micro-batch of ``stage`` saves for backward: the rank's measured peak over the most micro-batches
        it held at once, shared among its stages."""
        h = self.host
        held = h.stats.get(stage, {}).get("held", [])
        peak = h.stats.get(-1, {}).get("peak", [0.0])
        return max(peak) / max(1.0, max(held, default=1.0)) / max(1, len(h.pp.bundle.stages_of(h.index)))
