"""Checkpoint manifests: a directory holds one file per layer plus ``manifest.json``, written last.

Layers are saved by global index, so a checkpoint restores onto any partition (and any stage count). The manifest
(plain JSON) says what the files belong to; its presence marks the checkpoint complete.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.core.errors import ProfileError

MANIFEST = "manifest.json"


def layer_file(path: str | Path, index: int) -> Path:
    return Path(path) / f"layer-{index:05d}.pt"


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

    def write(self, path: str | Path) -> None:
        target = Path(path) / MANIFEST
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps({"kind": "vpipe_lab-checkpoint", "version": 1, **asdict(self)}, indent=1))
        os.replace(tmp, target)  # atomic: a manifest is either absent or complete

    @classmethod
    def read(cls, path: str | Path) -> Manifest:
        target = Path(path) / MANIFEST
        try:
            doc = json.loads(target.read_text())
        except OSError as exc:
            raise ProfileError(f"{str(path)!r} is not a complete vpipe_lab checkpoint: cannot read {MANIFEST} "
                               f"({exc.strerror}); save one with session.save(path)") from None
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{target} is not valid JSON: {exc}") from None
        if doc.get("kind") != "vpipe_lab-checkpoint":
            raise ProfileError(f"{target} is not a vpipe_lab checkpoint manifest")
        doc.pop("kind")
        doc.pop("version", None)
        missing = [i for i in range(int(doc["num_layers"])) if not layer_file(path, i).exists()]
        if missing:
            raise ProfileError(f"checkpoint {str(path)!r} lacks the files of layers {missing[:10]}")
        return cls(**doc)
