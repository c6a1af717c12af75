"""Checkpoint versions: complete or invisible, checksummed, pruned, and never read from outside their directory."""

import json
from pathlib import Path

import pytest

from vpipe_lab.core.errors import ProfileError
from vpipe_lab.wire.checkpoint_format import (
    LATEST,
    Manifest,
    complete,
    layer_file,
    resolve,
    sha256,
    sums_file,
    write_synced,
)


def manifest(iteration: int = 7) -> Manifest:
    return Manifest(iteration=iteration, plan={"kind": "plan"}, num_layers=2, names=["0:A", "1:B"], seed=3,
                    plan_version=2)


def save(root: Path, name: str, payload: bytes, keep: int | None = None, iteration: int = 7) -> Path:
    """What two ranks and then rank 0 do in a save."""
    version = root / name
    version.mkdir(parents=True)
    for rank in range(2):
        write_synced(layer_file(version, rank), payload + bytes([rank]))
        sums_file(version, rank).write_text(json.dumps({layer_file(version, rank).name: sha256(payload + bytes([rank]))}))
    complete(version, manifest(iteration), 2, keep)
    return version


def test_a_version_becomes_visible_only_when_complete(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="not a complete vpipe_lab checkpoint"):
        Manifest.read(tmp_path)
    first = save(tmp_path, "ckpt-a", b"old")
    read = Manifest.read(tmp_path)
    assert resolve(tmp_path) == first and read.iteration == 7 and set(read.files) == {"layer-00000.pt", "layer-00001.pt"}
    # A second save dies after writing its layers, before rank 0 completes it: the first stays what resumes.
    half = tmp_path / "ckpt-b"
    half.mkdir()
    layer_file(half, 0).write_bytes(b"new")
    read = Manifest.read(tmp_path)
    assert read.directory == first and read.load_bytes(0) == b"old\x00"
    second = save(tmp_path, "ckpt-c", b"new", keep=1, iteration=9)
    assert Manifest.read(tmp_path).iteration == 9 and (tmp_path / LATEST).read_text() == "ckpt-c"
    assert not first.exists() and not half.exists() and second.exists()  # pruned: newest 1, and the debris


def test_keep_keeps_the_newest_versions(tmp_path: Path) -> None:
    for i, name in enumerate(["ckpt-1", "ckpt-2", "ckpt-3"]):
        save(tmp_path, name, b"x", keep=2, iteration=i)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["ckpt-2", "ckpt-3"]


def test_a_corrupted_or_truncated_file_is_named(tmp_path: Path) -> None:
    version = save(tmp_path, "ckpt-a", b"payload")
    layer_file(version, 1).write_bytes(b"pay")
    with pytest.raises(ProfileError, match=r"layer-00001\.pt does not match its checksum"):
        Manifest.read(tmp_path).load_bytes(1)
    assert Manifest.read(tmp_path).load_bytes(0) == b"payload\x00"


def test_nothing_outside_the_checkpoint_is_read(tmp_path: Path) -> None:
    version = save(tmp_path, "ckpt-a", b"x")
    doc = json.loads((version / "manifest.json").read_text())
    doc["files"]["../../etc/passwd"] = "0" * 64
    (version / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match="not checkpoint files of its own directory"):
        Manifest.read(tmp_path)
    (tmp_path / LATEST).write_text("../elsewhere")
    with pytest.raises(ProfileError, match="not a checkpoint version"):
        Manifest.read(tmp_path)


def test_a_single_version_directory_reads_too(tmp_path: Path) -> None:
    manifest().write(tmp_path)
    with pytest.raises(ProfileError, match=r"lacks the files of layers \[0, 1\]"):
        Manifest.read(tmp_path)
    for i in range(2):
        layer_file(tmp_path, i).write_bytes(b"x")
    assert Manifest.read(tmp_path) == manifest()
    assert layer_file(tmp_path, 12).name == "layer-00012.pt"


@pytest.mark.parametrize(("field", "value", "said"), [
    ("iteration", "7", "manifest.iteration must be a whole number, got '7'"), ("iteration", -1, "iteration is -1"),
    ("num_layers", 0, "num_layers is 0"), ("names", [1, 2], "manifest.names[0] must be a string, got 1"),
    ("files", ["../x"], "manifest.files must be an object of strings, got ['../x']"), ("format", "pickle", "format is"),
    ("plan", [[[[[[[[[[1]]]]]]]]]], "manifest.plan must be an object, got [[[[...]]]]"),
    ("units", [3], "manifest.units[0] must be an object, got 3"), ("extra", None, "manifest.extra must be an object"),
    ("seed", True, "manifest.seed must be a whole number, got True"), ("evil", 1, "unknown field(s) ['evil']"),
])
def test_a_forged_manifest_is_refused_naming_the_field_before_anything_uses_it(tmp_path: Path, field: str,
                                                                                value: object, said: str) -> None:
    """A checkpoint is a file from someone else: a wrong type failed a worker later, in its own logging."""
    version = save(tmp_path, "ckpt-a", b"x")
    doc = json.loads((version / "manifest.json").read_text())
    doc[field] = value
    (version / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match="manifest") as caught:
        Manifest.read(tmp_path)
    assert said in str(caught.value) and "\n" not in str(caught.value)
    (version / "manifest.json").write_text("[" * 100_000)
    with pytest.raises(ProfileError, match="not a manifest this lab reads"):
        Manifest.read(tmp_path)
