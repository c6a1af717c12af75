"""A running pipeline's checkpoints: every stage writes its own layers, the leader completes the version.

The on-disk format (one file per layer, checksums per stage, a manifest, an atomic ``latest`` switch) is
``wire/checkpoint.py``'s; this module is the workers' side of it. Replicas hold the same state, so only the first
replica writes; every rank takes part in the agreement on whether the save succeeded.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from vpipe_lab.runtime.engine import faults
from vpipe_lab.runtime.engine.comm import Peer
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.wire.checkpoint import Manifest, complete, layer_file, sha256, sums_file, write_synced

log = logging.getLogger(__name__)


class Checkpoints:
    """Save this stage's layers into a checkpoint version, or restore them from one."""

    def __init__(self, peer: Peer, stage: Stage, rank: int, world: int, replica: int, leader: bool,
                 device: torch.device) -> None:
        self.peer, self.stage, self.device = peer, stage, device
        self.rank, self.world, self.replica, self.leader = rank, world, replica, leader

    def save(self, version: Path, manifest: Callable[[], Manifest], keep: int | None, iteration: int) -> str | None:
        """Every rank writes its layers (fsynced, with checksums) into ``version``; then the leader writes the manifest
        and switches ``latest`` to it: the previous version stays valid until then. A rank that cannot write (no
        space, no permission) does not stop training: all ranks agree the save failed and the reason (rank 0's view)
        is returned; None when it succeeded."""
        problem: str | None = None
        if self.replica == 0:  # the replicas hold the same state: the first one writes it, the others agree
            try:
                version.mkdir(parents=True, exist_ok=True)
                sums: dict[str, str] = {}
                for index in self.stage.owned:
                    buffer = io.BytesIO()
                    torch.save(self.stage.unit_state(index), buffer)
                    target = layer_file(version, index)
                    write_synced(target, buffer.getvalue())
                    sums[target.name] = sha256(buffer.getvalue())
                write_synced(sums_file(version, self.rank), json.dumps(sums).encode())
            except OSError as exc:
                problem = f"stage {self.rank} cannot write {exc.filename or version}: {exc.strerror or exc}"
                log.error("save failed: %s", problem)
        faults.hit(faults.parse(), "save", self.rank, iteration)
        if self.peer.all_max([1.0 if problem else 0.0])[0] > 0:  # everyone learns; nothing is switched
            return problem or "another stage could not write its layers"
        if self.leader:
            try:
                complete(version, manifest(), self.world, keep)
            except OSError as exc:
                problem = f"stage 0 cannot complete the checkpoint in {version}: {exc.strerror or exc}"
        if self.peer.all_max([1.0 if problem else 0.0])[0] > 0:
            return problem or "stage 0 could not complete the checkpoint"
        return None

    def restore(self, path: Path, num_layers: int) -> Manifest:
        """Load this stage's layers (checked against their checksums) and their optimizer state from ``path``."""
        manifest = Manifest.read(path)
        if manifest.num_layers != num_layers:
            raise ValueError(f"checkpoint {path} holds {manifest.num_layers} layers but the model has "
                             f"{num_layers}: resume with the model that was saved")
        states: dict[str, dict[str, object]] = {}
        groups: list[dict[str, object]] = []
        for index in self.stage.owned:
            data = io.BytesIO(manifest.load_bytes(index))
            state = torch.load(data, map_location=self.device, weights_only=True)
            self.stage.load_values(state["tensors"])
            states.update(state["optimizer"])
            groups += state.get("groups", [])  # absent in checkpoints written before parameter groups
        self.stage.load_optimizer(states, groups)
        log.info("restored layers %s from %s at iteration %d", self.stage.owned, path, manifest.iteration)
        return manifest
