"""Snapshots on a worker: when they are due (the same answer on every rank), what a copy holds, the batch buffer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from vpipe_lab.runtime.disk.snapshots import LONGEST, BatchBuffer, Snapshots, copy
from vpipe_lab.runtime.model.batches import Source
from vpipe_lab.wire import snapshot_format
from vpipe_lab.wire.snapshot_format import SnapshotMeta


def test_due_the_first_boundary_on_a_change_and_every_k_iterations(tmp_path: Path) -> None:
    snaps = Snapshots(str(tmp_path), 0, 2, 0, every=None)
    assert snaps.due(0, (0, 0))  # the first boundary: a failure before K iterations goes back to the start
    snaps.take(0, (0, 0), lambda: {"w": torch.ones(2)}, lambda: SnapshotMeta(0, {}, 0, 0))
    snaps.join()
    snaps.observe(0.1)
    snaps.agree(0.0, 0.02)  # the most expensive rank's copy costs 2% of an iteration: every iteration stays <= 5%
    assert snaps.interval == 1 and snaps.due(1, (0, 0)) and not snaps.due(0, (0, 0))
    snaps.agree(0.0, 0.5)  # 50%: every 10th iteration
    assert snaps.interval == 10 and not snaps.due(9, (0, 0)) and snaps.due(10, (0, 0))
    assert snaps.due(3, (1, 0))  # a plan change is snapshotted at once
    snaps.agree(1.0, 0.5)  # some rank's writer is still busy: wait for it
    assert not snaps.due(10, (0, 0))
    snaps.agree(0.0, 1e9)
    assert snaps.interval == LONGEST  # however costly, a restart never replays more than this
    assert Snapshots(str(tmp_path), 0, 2, 0, every=7).interval == 7
    assert not Snapshots(None, 0, 2, 0, every=None).due(0, (0, 0))  # no restarts asked for: no snapshots


def test_a_snapshot_is_a_copy_written_as_a_dcp_directory(tmp_path: Path) -> None:
    w = torch.arange(4.0)
    state = {"layer.weight": w, "optimizer": {"state.layer.weight.exp_avg": w * 2, "param_groups.layer.weight.lr": 0.1}}
    snaps = Snapshots(str(tmp_path), 1, 2, 0, every=None)
    snaps.take(5, (2, 0), lambda: state, None)
    w.add_(100)  # training goes on while the copy is written
    snaps.join()
    assert snaps.cost_s > 0 and not snaps.busy()
    where = snapshot_format.directory(tmp_path, (5, 2, 0))
    assert (where / "stage-1.done").exists() and not snapshot_format.is_complete(tmp_path, (5, 2, 0))
    back = {"layer.weight": torch.zeros(4), "optimizer": {"state.layer.weight.exp_avg": torch.zeros(4)}}
    dcp.load(back, checkpoint_id=str(where / "stage-1"), no_dist=True)
    assert torch.equal(back["layer.weight"], torch.arange(4.0))
    assert torch.equal(back["optimizer"]["state.layer.weight.exp_avg"], 2 * torch.arange(4.0))


def test_a_replica_writes_nothing_but_keeps_in_step(tmp_path: Path) -> None:
    snaps = Snapshots(str(tmp_path), 0, 2, 1, every=None)
    snaps.take(0, (0, 0), lambda: pytest.fail("a replica holds the first replica's state"), None)  # type: ignore[arg-type,return-value]
    assert snaps.last == 0 and snapshot_format.keys(tmp_path) == []


def test_copy_leaves_nothing_shared() -> None:
    t = torch.ones(3)
    out = copy({"a": t, "b": {"c": t, "d": 1.5}})
    t.zero_()
    assert torch.equal(out["a"], torch.ones(3)) and torch.equal(out["b"]["c"], torch.ones(3)) and out["b"]["d"] == 1.5


class Stream:
    """Other batches on every pass, as a stream or random augmentation gives."""

    passes = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        Stream.passes += 1
        for i in range(100):
            yield torch.full((2,), 1000.0 * Stream.passes + i), torch.zeros(2)


def test_a_restarted_source_replays_the_buffered_batches_then_reads_on(tmp_path: Path) -> None:
    buffer = BatchBuffer(tmp_path)
    first = Source(Stream(), 0, buffer)
    seen = [float(first.get(i)[0][0]) for i in range(5)]
    assert seen == [1000.0, 1001.0, 1002.0, 1003.0, 1004.0]
    again = Source(Stream(), 2, buffer)  # a replacement rank 0, restarted from the snapshot of iteration 2
    replayed = [float(again.get(i)[0][0]) for i in range(2, 6)]
    # batches 2-4 as the first run read them; batch 5 from a new pass over the data, read on past the first five
    assert replayed == [1002.0, 1003.0, 1004.0, 2005.0]
    with pytest.raises(ValueError, match="read in order"):
        again.get(9)


def test_a_snapshot_that_meets_a_full_disk_is_one_line_and_leaves_nothing_half_written(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """docs/security.md: the writer thread meets a real full file system; training's side never sees an exception."""
    from tests.full_disk import fill, small_filesystem

    with small_filesystem(tmp_path, 256) as disk:
        if disk is None:
            pytest.skip("this machine cannot mount a small file system; the injected ENOSPC test covers the path")
        snaps = Snapshots(str(disk / "snaps"), 0, 1, 0, every=None)
        snaps.take(0, (0, 0), lambda: {"w": torch.ones(4)}, lambda: SnapshotMeta(0, {"boundaries": [0, 1]}, 0, 0))
        snaps.join()
        assert snapshot_format.newest(disk / "snaps") is not None and snaps.failures == 0
        fill(disk, leave=8192)
        with caplog.at_level("ERROR"):
            snaps.take(1, (0, 0), lambda: {"w": torch.ones(64 * 1024)}, lambda: SnapshotMeta(1, {"boundaries": [0, 1]},
                                                                                              0, 0))
            snaps.join()
        assert snaps.failures == 1
        said = [r.getMessage() for r in caplog.records if "was not written" in r.getMessage()]
        assert len(said) == 1 and "no space left" in said[0] and "\n" not in said[0]
        assert not (snapshot_format.directory(disk / "snaps", (1, 0, 0)) / "stage-0").exists()
        newest = snapshot_format.newest(disk / "snaps")
        assert newest is not None and newest[1].iteration == 0  # a restart still goes back to the whole one
        buffer = BatchBuffer(disk / "snaps")
        buffer.put(7, {"x": torch.ones(64 * 1024)})  # the batch buffer on the same full disk: said, not raised
        assert buffer.get(7) is None and not list((disk / "snaps" / "batches").glob("*.tmp"))
