"""Restart snapshots on disk: which one is complete, which is newest, and what pruning keeps."""

from __future__ import annotations

from pathlib import Path

from vpipe_lab.wire import snapshot_format
from vpipe_lab.wire.snapshot_format import SnapshotMeta


def make(root: Path, key: tuple[int, int, int], stages: int, done: int | None = None) -> None:
    where = snapshot_format.directory(root, key)
    where.mkdir(parents=True)
    SnapshotMeta(key[0], {"boundaries": [0, 1, 2]}, key[1], key[2]).write(where)
    for stage in range(stages if done is None else done):
        snapshot_format.mark_done(root, key, stage)




def test_newest_and_prune(tmp_path: Path) -> None:
    assert snapshot_format.newest(tmp_path) is None
    make(tmp_path, (10, 0, 0), 2)
    make(tmp_path, (20, 0, 0), 2, done=1)  # a stage died while writing it
    where, meta = snapshot_format.newest(tmp_path)  # type: ignore[misc]
    assert meta.iteration == 10 and where.name == "it-0000000010-v0-m0"
    make(tmp_path, (20, 1, 0), 2)  # a change while paused: the same iteration, a newer plan version
    assert snapshot_format.newest(tmp_path)[1].plan_version == 1  # type: ignore[index]
    for it in (9, 15, 21):
        path = snapshot_format.batch_file(tmp_path, it)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")
    snapshot_format.prune(tmp_path)
    assert snapshot_format.keys(tmp_path) == [(20, 1, 0)]  # older ones, complete or not, are gone
    assert snapshot_format.buffered(tmp_path) == [21]  # the batches a restart from iteration 20 replays


def test_a_meta_file_is_whole_or_absent(tmp_path: Path) -> None:
    meta = SnapshotMeta(3, {"a": 1}, 2, 0, ["x"], {"scale": 2.0})
    meta.write(tmp_path)
    assert SnapshotMeta.read(tmp_path) == meta and not list(tmp_path.glob(".*tmp"))
