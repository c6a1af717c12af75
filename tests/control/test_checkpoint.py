from pathlib import Path

import pytest

from vpipe_lab.control.checkpoint import Manifest, layer_file
from vpipe_lab.core.errors import ProfileError


def test_manifest_round_trip_and_completeness(tmp_path: Path) -> None:
    m = Manifest(iteration=7, plan={"kind": "plan"}, num_layers=2, names=["0:A", "1:B"], seed=3, plan_version=2)
    with pytest.raises(ProfileError, match="not a complete vpipe_lab checkpoint"):
        Manifest.read(tmp_path)
    m.write(tmp_path)
    with pytest.raises(ProfileError, match=r"lacks the files of layers \[0, 1\]"):
        Manifest.read(tmp_path)
    for i in range(2):
        layer_file(tmp_path, i).write_bytes(b"x")
    assert Manifest.read(tmp_path) == m
    assert layer_file(tmp_path, 12).name == "layer-00012.pt"
