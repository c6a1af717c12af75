"""Checkpoints that are never half-written: versions in fresh directories, switched by an atomic ``latest`` pointer.

A checkpoint path is a directory of versions. Each save writes a new version directory next to the others: a
torch.distributed.checkpoint (DCP) checkpoint, every rank writing its own ``__<rank>_<n>.distcp`` files (fsynced) and
rank 0 the ``.metadata``, keyed by the user's model's own ``state_dict()`` names (``runtime/disk/dcp_state.py``), so
``dcp.load(model.state_dict(), checkpoint_id=version)`` reads it without vpipe_lab; plus per-rank checksum lists.
Then rank 0 writes the version's ``manifest.json`` (the plan, iteration, units and every file's SHA-256) and finally
replaces ``latest`` (a one-line file naming the version) atomically: until that rename the previous version is what
``latest`` names, complete and untouched. Older versions beyond the newest ``keep`` are removed after the switch.
Tensors are saved by name, so a checkpoint restores onto any partition (and any stage count). Earlier releases
wrote one file per layer (``format: "layers"``); those still resume. A directory holding ``manifest.json`` itself
(one version) reads too, and so does a DCP checkpoint torch wrote (``.metadata``, no manifest: ``is_foreign``).
Resume checks every file against its checksum and names the file that does not match.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import reprlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.core import documents
from vpipe_lab.core.errors import ProfileError
from vpipe_lab.wire import small_file

MANIFEST = "manifest.json"
LATEST = "latest"
_VERSION = re.compile(r"^ckpt-[0-9a-z-]+$")
_LAYER = re.compile(r"^layer-\d{5}\.pt$")
_DCP = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")  # what torch.distributed.checkpoint's FileSystemWriter writes
DCP_METADATA = ".metadata"


def layer_file(path: str | Path, index: int) -> Path:
    return Path(path) / f"layer-{index:05d}.pt"


def sums_file(version: Path, rank: int) -> Path:
    return version / f"sums-rank{rank}.json"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to disk before returning."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def resolve(path: str | Path) -> Path:
    """The version directory a checkpoint path stands for: what ``latest`` names, or the path itself."""
    root = Path(path)
    pointer = root / LATEST
    if pointer.exists():
        name = pointer.read_text().strip()
        if not _VERSION.match(name):
            raise ProfileError(f"{pointer} names {name!r}, not a checkpoint version in {root}: it may only name a "
                               "directory beside it")
        return root / name
    return root


@dataclass
class Manifest:
    iteration: int
    plan: dict[str, Any]
    num_layers: int
    names: list[str]
    seed: int
    plan_version: int = 0
    model_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # file name -> SHA-256
    format: str = "layers"  # "dcp" (torch.distributed.checkpoint) or "layers" (one file per layer, before DCP)
    units: list[dict[str, Any]] = field(default_factory=list)  # the units' descriptions (core.interop.bundle.UnitInfo)
    directory: Path | None = field(default=None, compare=False,  # where it was read from (not written)
                                   metadata={"document": False})

    def __post_init__(self) -> None:
        # A checkpoint is a file from someone else: a count out of range or an unknown format failed a worker later,
        # in its own logging or arithmetic, far from the cause (the types are checked as it is read).
        for key in ("iteration", "num_layers", "seed", "plan_version", "model_version"):
            if getattr(self, key) < (1 if key == "num_layers" else 0):
                raise ProfileError(f"{key} is {getattr(self, key)!r}, not what a vpipe_lab manifest holds there")
        if self.format not in ("dcp", "layers"):
            raise ProfileError(f"format is {reprlib.repr(self.format)}, not 'dcp' or 'layers'")

    def write(self, version: Path) -> None:
        doc = documents.dump(self)
        target = version / MANIFEST
        tmp = target.with_suffix(".tmp")
        write_synced(tmp, json.dumps({"kind": "vpipe_lab-checkpoint", "version": 2, **doc}, indent=1).encode())
        os.replace(tmp, target)  # a manifest is either absent or complete
        sync_dir(version)

    @classmethod
    def read(cls, path: str | Path) -> Manifest:
        """The manifest of the checkpoint at ``path`` (its newest complete version), checked for completeness."""
        version = resolve(path)
        target = version / MANIFEST
        try:
            doc = json.loads(small_file.read_text(target, "the checkpoint's manifest"))
        except OSError as exc:
            raise ProfileError(f"{str(path)!r} is not a complete vpipe_lab checkpoint: cannot read {target.name} "
                               f"({exc.strerror}); save one with session.save(path)") from None
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{target} is not valid JSON: {exc}") from None
        except (RecursionError, ValueError) as exc:  # not text, nested past the parser, a 5,000-digit number
            raise ProfileError(f"{target} is not a manifest this lab reads: {exc}") from None
        if not isinstance(doc, dict) or doc.get("kind") != "vpipe_lab-checkpoint":
            raise ProfileError(f"{target} is not a vpipe_lab checkpoint manifest")
        doc.pop("kind")
        doc.pop("version", None)
        try:
            manifest = documents.load_fields(cls, doc, "manifest", ProfileError)
        except ProfileError as exc:
            raise ProfileError(f"{target}: {exc}; the manifest is corrupt or forged, and nothing of it is used") from None
        manifest.directory = version
        allowed = _DCP if manifest.format == "dcp" else _LAYER
        outside = [name for name in manifest.files if not allowed.match(name)]
        if outside:
            raise ProfileError(f"{target} lists files {outside[:3]} that are not checkpoint files of its own directory; "
                               "the manifest is corrupt or forged, and nothing outside the checkpoint is read")
        if manifest.format == "dcp":
            absent = [n for n in [DCP_METADATA, *manifest.files] if not (version / n).exists()]
            if absent:
                raise ProfileError(f"checkpoint {str(path)!r} lacks its files {absent[:5]}")
            return manifest
        missing = [i for i in range(manifest.num_layers) if not layer_file(version, i).exists()]
        if missing:
            raise ProfileError(f"checkpoint {str(path)!r} lacks the files of layers {missing[:10]}")
        return manifest

    def check_file(self, name: str) -> None:
        """Raise ProfileError naming file ``name`` if it does not match the manifest's checksum."""
        assert self.directory is not None
        expected = self.files.get(name)
        path = self.directory / name
        if expected is not None and sha256(path.read_bytes()) != expected:
            raise ProfileError(f"checkpoint file {path} does not match its checksum (corrupted or truncated); resume "
                               "from another checkpoint version")

    def load_bytes(self, index: int) -> bytes:
        """Layer ``index``'s file, checked against the manifest's checksum."""
        assert self.directory is not None
        path = layer_file(self.directory, index)
        data = path.read_bytes()
        expected = self.files.get(path.name)
        if expected is not None and sha256(data) != expected:
            raise ProfileError(f"checkpoint file {path} does not match its checksum (corrupted or truncated); resume "
                               "from another checkpoint version")
        return data


def is_foreign(path: str | Path) -> bool:
    """Whether ``path`` is a DCP checkpoint vpipe_lab did not write (torch's ``.metadata``, no manifest)."""
    version = resolve(path)
    return (version / DCP_METADATA).exists() and not (version / MANIFEST).exists()


def complete(version: Path, manifest: Manifest, ranks: int, keep: int | None) -> None:
    """Rank 0's last step of a save: gather every rank's checksums into the manifest, write it, switch ``latest``
    to this version, then prune old versions beyond ``keep``."""
    for rank in range(ranks):
        sums = sums_file(version, rank)
        if sums.exists():  # a rank with nothing to write (a replica) writes no list
            manifest.files.update(json.loads(sums.read_text()))
    if (version / DCP_METADATA).exists():
        manifest.files[DCP_METADATA] = sha256((version / DCP_METADATA).read_bytes())
    manifest.write(version)
    root = version.parent
    pointer = root / LATEST
    tmp = root / f".{LATEST}.tmp"
    write_synced(tmp, version.name.encode())
    os.replace(tmp, pointer)
    sync_dir(root)
    if keep is not None:
        prune(root, keep)


def prune(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete versions (never the one ``latest`` names) and unfinished ones."""
    current = resolve(root).name
    versions = [p for p in root.iterdir() if p.is_dir() and _VERSION.match(p.name)]
    finished = sorted((p for p in versions if (p / MANIFEST).exists()), key=lambda p: (p / MANIFEST).stat().st_mtime)
    doomed = [p for p in finished[:-keep] if p.name != current] if keep > 0 else []
    doomed += [p for p in versions if not (p / MANIFEST).exists() and p.name != current]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
