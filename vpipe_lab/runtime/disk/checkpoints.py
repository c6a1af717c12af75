"""A running pipeline's checkpoints: every stage writes its own units into one torch.distributed.checkpoint (DCP)
version, the leader completes it; a restore reads each stage's units by name from any such checkpoint.

The on-disk format (DCP files, checksums per stage, a manifest, an atomic ``latest`` switch) is
``wire/checkpoint_format.py``'s and the keys are ``runtime/disk/dcp_state.py``'s; this module is the workers' side of it.
Replicas hold the same state, so only the first replica contributes tensors (every rank takes part in DCP's agreement and in
ours on whether the save succeeded). A restore reads DCP checkpoints the lab wrote under any partition, stage count
or schedule, DCP checkpoints torch or torchtitan wrote of the same model, and the per-layer files of earlier releases.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from vpipe_lab.core.report import human_bytes
from vpipe_lab.runtime.disk import dcp_state
from vpipe_lab.runtime.engine import faults
from vpipe_lab.runtime.engine.comm import Peer
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.wire.checkpoint_format import (
    DCP_METADATA,
    MANIFEST,
    Manifest,
    complete,
    is_foreign,
    resolve,
    sha256,
    sums_file,
    write_synced,
)

log = logging.getLogger(__name__)
FULL_BELOW = 64 << 10  # a failed write that left less than this free on its file system met a full disk


class Checkpoints:
    """Save this stage's units into a checkpoint version, or restore them from one."""

    def __init__(self, peer: Peer, stage: Stage, rank: int, world: int, replica: int, leader: bool,
                 device: torch.device, keys: Callable[[], tuple[Mapping[str, list[str]], set[str]]] | None = None
                 ) -> None:
        self.peer, self.stage, self.device = peer, stage, device
        self.rank, self.world, self.replica, self.leader = rank, world, replica, leader
        # The model's names, asked for at each save or restore (a model change brings new ones): canonical tensor name
        # -> its keys in the user's model.state_dict(), and the non-persistent buffers. None: a stage built by hand,
        # whose tensors are saved under their own names.
        self.keys = keys or (lambda: ({}, set()))

    def save(self, version: Path, manifest: Callable[[], Manifest], keep: int | None, iteration: int) -> str | None:
        """Every rank writes its units into the DCP checkpoint ``version``; see ``write_version``."""
        state = self.state(iteration) if self.replica == 0 else {}
        return write_version(self.peer, self.rank, self.world, self.replica, self.leader, version, state, manifest,
                             keep, iteration)

    def restore(self, path: Path, num_layers: int) -> Manifest:
        """Load this stage's units (checked against their checksums) and their optimizer state from ``path``: a
        checkpoint the lab wrote (DCP or per-layer files) or a DCP checkpoint torch wrote of the same model (its
        weights, and its optimizer state where it holds one in torch's flattened layout; the run's iteration count
        starts at 0, whatever step the other job was at)."""
        if is_foreign(path):
            manifest = Manifest(0, {}, num_layers, [], 0, format="dcp", directory=resolve(path))
        else:
            manifest = Manifest.read(path)
            if manifest.num_layers != num_layers:
                raise ValueError(f"checkpoint {path} holds {manifest.num_layers} layers but the model has "
                                 f"{num_layers}: resume with the model that was saved")
        if manifest.format != "dcp":
            return self._restore_layers(path, manifest)
        check_files(self.peer, self.rank, self.world, self.replica, manifest)
        assert manifest.directory is not None
        # a checkpoint the lab wrote reads only the files its manifest checksums; torch's own, plain names inside it
        self.load_directory(manifest.directory, listed=None if is_foreign(path) else set(manifest.files))
        log.info("restored units %s from %s at iteration %d", self.stage.owned, manifest.directory, manifest.iteration)
        return manifest

    def load_directory(self, directory: Path | Sequence[Path], listed: set[str] | None = None) -> None:
        """Read this stage's units (in place) and their optimizer state from the DCP directory ``directory``, or from
        several, each key from the one that has it (a restart snapshot: one directory per stage that wrote it, read
        under another partition when the job goes on with fewer stages). Nothing is read unless every key is found
        and every file the metadata names is a plain file of the directory (one of ``listed``, when given)."""
        directories = [directory] if isinstance(directory, Path) else list(directory)
        aliases, non_persistent = self.keys()
        reads = []
        missing: list[str] | None = None
        for where in directories:
            reader = dcp_state.SafeReader(str(where), listed)
            template, lacks = dcp_state.load_template(self.stage, aliases, non_persistent, reader.read_metadata())
            missing = lacks if missing is None else [k for k in missing if k in lacks]
            reads.append((reader, template))
        if missing:
            shown = " or ".join(str(d) for d in directories)
            raise ValueError(f"checkpoint {shown} has no {', '.join(missing[:3])}"
                             f"{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}: it was saved from another "
                             "model (the keys are the model's own state_dict() names)")
        for reader, template in reads:
            if not template:
                continue
            with torch.no_grad():
                dcp.load(template, storage_reader=reader, planner=dcp_state.SafeLoadPlanner(), no_dist=True)
            dcp_state.restore_optimizer(self.stage, template)

    def state(self, iteration: int) -> dict[str, Any]:
        """This stage's units as a DCP state dict (the live tensors: copy them before training changes them)."""
        aliases, non_persistent = self.keys()
        return dcp_state.save_state(self.stage, aliases, non_persistent, iteration)

    def _restore_layers(self, path: Path, manifest: Manifest) -> Manifest:
        """A checkpoint of earlier releases: one file per layer, each checked against its checksum."""
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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def write_version(peer: Peer, rank: int, world: int, replica: int, leader: bool, version: Path,
                  state: dict[str, Any], manifest: Callable[[], Manifest], keep: int | None, iteration: int
                  ) -> str | None:
    """Every rank writes ``state`` (its part of a DCP state dict; ``{}`` for a replica) into the checkpoint ``version``
    (fsynced, checksummed); then the leader writes the manifest and switches ``latest`` to it: the previous version
    stays valid until then. A rank that cannot write (no space, no permission) does not stop training: all ranks
    agree the save failed and the reason (rank 0's view) is returned; None when it succeeded."""
    problem: str | None = None
    needed = state_bytes(state)
    try:
        version.mkdir(parents=True, exist_ok=True)
        free = free_bytes(version)
        if free is not None and needed > free:  # a save that cannot fit is not begun: nothing half-written to clean
            problem = (f"no space left for stage {rank}'s {human_bytes(needed)} in {version} "
                       f"({human_bytes(free)} free there)")
    except OSError as exc:
        problem = f"stage {rank} cannot write {exc.filename or version}: {exc.strerror or exc}"
    # DCP's save is collective: every rank joins it, or none does (a rank that cannot even make the directory)
    if peer.all_max([1.0 if problem else 0.0])[0] == 0:
        try:
            writer = _Writer(str(version), sync_files=True, thread_count=1, overwrite=True)
            writer.fault_at = (rank, iteration)
            dcp.save(state, storage_writer=writer, no_dist=not _distributed())
            if replica == 0:
                mine = dist.get_rank() if _distributed() else 0
                sums = {p.name: sha256(p.read_bytes()) for p in sorted(version.glob(f"__{mine}_*.distcp"))}
                write_synced(sums_file(version, rank), json.dumps(sums).encode())
        # DCP raises every rank's failure on every rank as a CheckpointException, which is a BaseException: an
        # ``except Exception`` let a full disk end the session
        except (Exception, CheckpointException) as exc:
            problem = f"stage {rank} cannot write the checkpoint in {version}: {reason(exc, version)}"
    if problem:
        log.error("save failed: %s", problem)
    faults.hit(faults.parse(), "save", rank, iteration)
    if peer.all_max([1.0 if problem else 0.0])[0] > 0:  # everyone learns; nothing is switched
        discard(version)
        return problem or "another stage could not write its units"
    if leader:
        try:
            written = manifest()
            written.format = "dcp"
            complete(version, written, world, keep)
        except OSError as exc:
            problem = f"stage 0 cannot complete the checkpoint in {version}: {reason(exc, version)}"
    if peer.all_max([1.0 if problem else 0.0])[0] > 0:
        discard(version)
        return problem or "stage 0 could not complete the checkpoint"
    return None


class _Writer(dcp.FileSystemWriter):
    """DCP's file-system writer, where the fault tests inject a full disk (``VPIPE_LAB_FAULT=write:RANK:enospc``):
    inside DCP's collective write, so it fails as a real full disk does, on every rank at once."""

    fault_at: tuple[int, int] = (-1, 0)  # (stage, iteration)

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        faults.hit(faults.parse(), "write", *self.fault_at)
        return super().write_data(*args, **kwargs)


def discard(version: Path) -> None:
    """Remove a version whose save failed (every rank, after all agreed it failed: no rank still writes there), so a
    full disk gets its space back; never a version with a manifest, which a save that reused its name left complete."""
    if version.is_dir() and not (version / MANIFEST).exists():
        shutil.rmtree(version, ignore_errors=True)


def state_bytes(state: Mapping[str, Any]) -> int:
    """What writing ``state`` puts on disk, near enough to tell whether it fits: its tensors' bytes."""
    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor: this rank's shard
            total += local.numel() * local.element_size()
        elif isinstance(value, Mapping):
            total += state_bytes(value)
    return total


def free_bytes(path: Path) -> int | None:
    """The bytes an unprivileged writer may still put on ``path``'s file system, or None where it cannot be told."""
    try:
        info = os.statvfs(path)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def check_files(peer: Peer, rank: int, world: int, replica: int, manifest: Manifest) -> None:
    """The first replica's ranks each check a share of the version's files against the manifest's checksums;
    every rank then raises the first finder's words, so whichever stage is reported names the file."""
    names = [*sorted(n for n in manifest.files if n != DCP_METADATA), DCP_METADATA]
    problem = ""
    for name in names[rank::max(1, world)] if replica == 0 else []:
        try:
            manifest.check_file(name)
        except Exception as exc:
            problem = str(exc)
            break
    finder = int(peer.all_max([float(rank) if problem else -1.0])[0])
    if finder >= 0:  # a first-replica rank: its global rank is its stage
        raise ValueError(peer.broadcast_json(problem, src=finder) if _distributed() else problem)


def reason(exc: BaseException, where: Path | None = None) -> str:
    """The first line of what went wrong: "no space left" when the file system is full (torch's writer reports a
    full disk as ``unexpected pos 704 vs 598``), OSError's words where there is one (DCP wraps each rank's failure
    as ``(exception, traceback)``), else the first line of the message."""
    seen = [exc]
    while seen[-1].__cause__ is not None and len(seen) < 5:
        seen.append(seen[-1].__cause__)
    for e in list(seen):
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and failures:
            inner = next(iter(failures.values()))
            inner = inner[0] if isinstance(inner, tuple) and inner else inner
            if isinstance(inner, BaseException):
                seen.append(inner)
    os_error = next((e for e in seen if isinstance(e, OSError)), None)
    free = free_bytes(where) if where is not None else None
    if (os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT)) or (free is not None and
                                                                                   free < FULL_BELOW):
        return f"no space left on the device that holds {where if where is not None else os_error.filename}"
    if os_error is not None:
        return f"{os_error.filename or ''} {os_error.strerror or os_error}".strip()
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

