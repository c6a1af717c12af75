"""Restart snapshots on local disk: where each stage's copy lives, when a snapshot is complete, and what is pruned.

The workers write them (``runtime/disk/snapshots.py``); the controller restarts a failed job from the newest complete one
(``control/workers/restarts.py``) and reads nothing else of them. Layout under a job's snapshot root::

    it-0000000040-v2-m0/stage-0/       a DCP directory stage 0 wrote alone (its units' model keys and optimizer state)
    it-0000000040-v2-m0/stage-0.done   written once that directory is on disk: the stage's part is complete
    it-0000000040-v2-m0/meta.json      rank 0: the iteration, the plan in force, its version, the loss scale
    batches/batch-0000000041.pt        rank 0: a batch read from an iterable since the newest complete snapshot

A snapshot is named by its iteration and the (plan, model) versions in force: a change applied while training is
paused is snapshotted at the same iteration as the one before it, which stays whole until the new one is complete.

A snapshot is complete when ``meta.json`` and every stage's ``.done`` exist; a worker killed while writing leaves an
incomplete one, which is never used and is pruned once a newer one is complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.core import documents

_NAME = re.compile(r"^it-(\d{10})-v(\d+)-m(\d+)$")
BATCHES = "batches"
Key = tuple[int, int, int]  # (iteration, plan version, model version): newer sorts later


@dataclass
class SnapshotMeta:
    """What the whole pipeline was at the snapshot's iteration boundary (rank 0 writes it)."""

    iteration: int  # iterations completed when it was taken: training restarts here
    plan: dict[str, Any]
    plan_version: int
    model_version: int
    names: list[str] = field(default_factory=list)
    loss_scale: dict[str, Any] = field(default_factory=dict)

    @property
    def stages(self) -> int:
        """The stages that took it (each wrote a directory): the plan's chunks over its chunks per stage."""
        return max(1, (len(self.plan.get("boundaries", [0, 0])) - 1) // int(self.plan.get("virtual_stages", 1)))

    @classmethod
    def read(cls, directory: Path) -> SnapshotMeta:
        return documents.load_fields(cls, json.loads((directory / "meta.json").read_text()), f"{directory}/meta.json",
                                     ValueError)

    def write(self, directory: Path) -> None:
        tmp = directory / ".meta.json.tmp"
        tmp.write_text(json.dumps(documents.dump(self)))
        os.replace(tmp, directory / "meta.json")  # whole or absent: a reader never sees half of it


def directory(root: Path, key: Key) -> Path:
    iteration, plan_version, model_version = key
    return root / f"it-{iteration:010d}-v{plan_version}-m{model_version}"


def stage_dir(where: Path, stage: int) -> Path:
    """The DCP directory ``stage`` writes into the snapshot directory ``where``."""
    return where / f"stage-{stage}"


def _done(where: Path, stage: int) -> Path:
    return where / f"stage-{stage}.done"


def mark_done(root: Path, key: Key, stage: int) -> None:
    _done(directory(root, key), stage).touch()


def batch_file(root: Path, iteration: int) -> Path:
    return root / BATCHES / f"batch-{iteration:010d}.pt"


def keys(root: Path) -> list[Key]:
    """The snapshots under ``root``, complete or not, oldest first."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [_NAME.match(n) for n in names]
    return sorted((int(m[1]), int(m[2]), int(m[3])) for m in found if m)


def is_complete(root: Path, key: Key) -> bool:
    """Rank 0's ``meta.json`` and a ``.done`` of every stage its plan had (a job that went on with fewer stages still
    restarts from a snapshot the larger pipeline took)."""
    where = directory(root, key)
    try:
        stages = SnapshotMeta.read(where).stages
    except (OSError, ValueError, TypeError):  # absent, or not written by this release
        return False
    return all(_done(where, s).exists() for s in range(stages))


def newest(root: Path) -> tuple[Path, SnapshotMeta] | None:
    """The newest complete snapshot (its directory and what rank 0 recorded), or None."""
    for key in reversed(keys(root)):
        if is_complete(root, key):
            where = directory(root, key)
            return where, SnapshotMeta.read(where)
    return None


def prune(root: Path) -> None:
    """Drop every snapshot older than the newest complete one, and the buffered batches before it."""
    complete = [k for k in keys(root) if is_complete(root, k)]
    if not complete:
        return
    for key in keys(root):
        if key < complete[-1]:
            shutil.rmtree(directory(root, key), ignore_errors=True)
    keep = complete[-1][0]
    for iteration in buffered(root):
        if iteration < keep:
            batch_file(root, iteration).unlink(missing_ok=True)


def buffered(root: Path) -> list[int]:
    """The iterations whose batches rank 0 buffered, oldest first."""
    try:
        names = os.listdir(root / BATCHES)
    except OSError:
        return []
    return sorted(int(n[6:-3]) for n in names if n.startswith("batch-") and n.endswith(".pt") and n[6:-3].isdigit())
