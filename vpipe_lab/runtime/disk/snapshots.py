"""Snapshots a failed job restarts from: each stage's state copied at an iteration boundary and written to local disk
by a background thread (``wire/snapshot_format.py`` says where), every K iterations, K chosen so they cost at most ~5%.

Every rank decides the same way at the same boundary: whether any rank's writer is still busy and the largest cost
ratio (copy + write time over iteration time) travel in the boundary's one all-reduce (``Worker.boundary``), so all
ranks snapshot the same iterations without another message. A plan or model change is snapshotted at once (the
restart then runs the plan in force), and so is the first boundary (a failure before the first periodic snapshot
goes back to the start, not to nothing). The copy is the only part training waits for: the write (a DCP directory per
stage, no collectives, so it cannot interleave with training's own) runs beside it. A process crash leaves the page
cache intact, so the files are not fsynced: a snapshot is for a dead worker, ``Session.save`` for a dead machine.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils import _pytree as pytree

from vpipe_lab.core.plan import Plan
from vpipe_lab.runtime.disk.checkpoints import reason
from vpipe_lab.runtime.engine import faults
from vpipe_lab.wire import snapshot_format as layout
from vpipe_lab.wire.snapshot_format import SnapshotMeta

log = logging.getLogger(__name__)

SHARE = 0.05  # the largest share of training time snapshots may cost
LONGEST = 500  # at most this many iterations between snapshots: what a restart may have to replay


def copy(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor copied to host memory (training changes the originals in place)."""
    return pytree.tree_map(lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, state)


class Snapshots:
    """One rank's snapshots: when they are due, taking one, and restoring a restarted rank from one."""

    def __init__(self, root: str | None, stage: int, stages: int, replica: int, every: int | None) -> None:
        self.root = Path(root) if root else None
        self.stage, self.stages, self.replica, self.every = stage, stages, replica, every
        self.last: int | None = None  # the iteration of the newest snapshot this rank took
        self._version: tuple[int, int] | None = None  # (plan version, model version) of that snapshot
        self._writer: threading.Thread | None = None
        self._busy_any = False
        self.interval = every or 1  # K, as the last boundary agreed it
        self.cost_s = 0.0  # the newest snapshot's copy + write time on this rank
        self.iteration_s = 0.0  # a running mean of the iteration time
        self.taken = 0
        self.failures = 0  # snapshots this rank could not write (a full disk)

    @property
    def on(self) -> bool:
        return self.root is not None

    def busy(self) -> bool:
        return self._writer is not None and self._writer.is_alive()

    def wish(self) -> list[float]:
        """This rank's part of the boundary's all-reduce: its writer busy (1) or not, its cost ratio."""
        ratio = self.cost_s / self.iteration_s if self.iteration_s > 0 else 0.0
        return [1.0 if self.busy() else 0.0, ratio]

    def agree(self, busy: float, ratio: float) -> None:
        """What every rank learnt at this boundary: any writer still busy, the largest cost ratio (the same K)."""
        self._busy_any = busy > 0
        self.interval = self.every or max(1, min(LONGEST, math.ceil(ratio / SHARE)))

    def observe(self, seconds: float) -> None:
        self.iteration_s = seconds if self.iteration_s == 0 else 0.8 * self.iteration_s + 0.2 * seconds

    def due(self, iteration: int, version: tuple[int, int]) -> bool:
        """A snapshot is taken at this boundary (the same answer on every rank)."""
        if self.root is None:
            return False
        if self.last is None or version != self._version:
            return True
        return not self._busy_any and iteration - self.last >= self.interval

    def take(self, iteration: int, version: tuple[int, int], state: Callable[[], dict[str, Any]],
             meta: Callable[[], SnapshotMeta] | None) -> None:
        """Copy this stage's state now and write it in the background; ``meta`` (rank 0) describes the pipeline."""
        assert self.root is not None
        root = self.root
        self.join()  # a forced snapshot may come while the last one is written: one writer at a time
        self.last, self._version = iteration, version
        self.taken += 1
        if self.replica != 0:  # the replicas hold the first replica's state
            return
        start = time.perf_counter()
        staged = copy(state())
        key = (iteration, *version)
        where = layout.directory(root, key)
        try:
            where.mkdir(parents=True, exist_ok=True)
            if meta is not None:
                meta().write(where)
        except OSError as exc:  # a full disk: training goes on, the previous snapshot stays the one a restart uses
            self._failed(iteration, exc, layout.stage_dir(where, self.stage))
            return
        copied = time.perf_counter() - start

        def write() -> None:
            begun = time.perf_counter()
            target = layout.stage_dir(where, self.stage)
            try:
                faults.hit(faults.parse(), "snapshot", self.stage, iteration)
                writer = dcp.FileSystemWriter(str(target), sync_files=False, thread_count=1, overwrite=True)
                dcp.save(staged, storage_writer=writer, no_dist=True)
                layout.mark_done(root, key, self.stage)
                if meta is not None:
                    layout.prune(root)
            # DCP's CheckpointException is a BaseException: ``except Exception`` let it end the writer with a traceback
            except (Exception, CheckpointException) as exc:
                self._failed(iteration, exc, target)
            self.cost_s = copied + time.perf_counter() - begun

        self._writer = threading.Thread(target=write, name="vpipe-snapshot", daemon=True)
        self._writer.start()

    def _failed(self, iteration: int, exc: BaseException, target: Path) -> None:
        """A snapshot that could not be written: said in one line, its partial files removed (a full disk gets its
        space back); the previous complete snapshot stays the one a restart uses, and training goes on."""
        shutil.rmtree(target, ignore_errors=True)
        self.failures += 1
        log.error("the snapshot of iteration %d on stage %d was not written: %s; training goes on and a restart "
                  "would use the previous one", iteration, self.stage, reason(exc, target.parent))

    def join(self, timeout: float | None = None) -> None:
        if self._writer is not None:
            self._writer.join(timeout)

    def restore(self, directory: Path, load: Callable[[list[Path]], None]) -> SnapshotMeta:
        """Read this stage's part of the snapshot in ``directory`` (``load`` reads DCP directories into the stage):
        its own stage's directory, or every stage's when the snapshot was taken on another number of stages (a job
        going on without a lost stage: each unit is read from whichever stage held it)."""
        meta = SnapshotMeta.read(directory)
        taken_on = Plan.from_dict(meta.plan).stages
        load([layout.stage_dir(directory, s) for s in (range(taken_on) if taken_on != self.stages else [self.stage])])
        self.last, self._version = meta.iteration, (meta.plan_version, meta.model_version)
        log.info("restarted from the snapshot of iteration %d (%s)", meta.iteration, directory)
        return meta


class BatchBuffer:
    """Rank 0 keeps each batch read from an iterable on local disk until a newer snapshot is complete
    (``wire/snapshot_format.prune``): a restart replays the batches the lost iterations read, as they were read."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, iteration: int, item: Any) -> None:
        """Keep the batch of ``iteration``; a disk too full to hold it is said in one line and training goes on (a
        restart to before it would then read the iterable afresh from there)."""
        path = layout.batch_file(self.root, iteration)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(item, tmp)
            tmp.replace(path)
        except (OSError, RuntimeError) as exc:  # torch's writer reports a full disk as a RuntimeError
            tmp.unlink(missing_ok=True)
            log.error("the batch of iteration %d was not kept for a restart: %s", iteration, reason(exc, self.root))

    def get(self, iteration: int) -> Any | None:
        path = layout.batch_file(self.root, iteration)
        return torch.load(path, weights_only=True) if path.exists() else None
