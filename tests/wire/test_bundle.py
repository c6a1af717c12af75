"""The export bundle on disk: every file written, read back checked, moved into place whole, never over a directory
that is not a bundle."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from vpipe_lab.core.errors import ProfileError
from vpipe_lab.core.interop.bundle import UnitInfo, make
from vpipe_lab.core.plan import Plan
from vpipe_lab.wire import bundle

UNITS = ([UnitInfo("embed", ("model.embed_tokens",), "pre")]
         + [UnitInfo(f"layer{i}", (f"model.layers.{i}",), "block:LlamaDecoderLayer") for i in range(4)]
         + [UnitInfo("head", ("model.norm", "lm_head"), "post")])


def test_a_bundle_has_every_file_and_reads_back(tmp_path: Path) -> None:
    b = make(Plan((0, 3, 6), tuple("kkrkkk"), 4, "eager-1f1b"), UNITS, microbatch_size=2, predicted_s=0.05,
             measured_s=0.06)
    root = bundle.write(tmp_path / "out", b)
    assert sorted(p.name for p in root.iterdir()) == sorted(bundle.FILES)
    assert bundle.read(root) == b and bundle.read(root / "pipeline.json") == b
    assert (root / "schedule.csv").read_text().splitlines()[1].startswith("1F0,1B0")
    toml = tomllib.loads((root / "torchtitan.toml").read_text())
    assert toml["parallelism"]["pipeline_parallel_schedule_csv"] == str(root / "schedule.csv")
    readme = (root / "README.md").read_text()
    assert "60.00 ms" in readme and "50.00 ms" in readme and "| 1 | 1 | `model.layers.2` |" in readme
    assert "--pipeline-model-parallel-layout" in (root / "megatron.args").read_text()
    assert json.loads((root / "pipeline.json").read_text())["schedule"] is None  # no torch class runs eager 1F1B


def test_a_bundle_replaces_a_bundle_and_nothing_else(tmp_path: Path) -> None:
    first = make(Plan((0, 3, 6), tuple("kkkkkk"), 4), UNITS)
    second = make(Plan((0, 2, 6), tuple("kkkkkk"), 4), UNITS)
    bundle.write(tmp_path / "b", first)
    bundle.write(tmp_path / "b", second)
    assert bundle.read(tmp_path / "b") == second
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no staging directory left
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not an export bundle"):
        bundle.write(tmp_path / "mine", first)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"
    with pytest.raises(ProfileError, match="cannot read the export bundle"):
        bundle.read(tmp_path / "missing")


def test_a_model_megatron_cannot_lay_out_gets_the_reason_in_its_readme(tmp_path: Path) -> None:
    units = [UnitInfo(str(i), (str(i),), "block:Linear") for i in range(4)]
    root = bundle.write(tmp_path / "b", make(Plan((0, 2, 4), tuple("kkkk"), 2), units))
    assert not (root / "megatron.args").exists()
    assert "No `megatron.args`: Megatron-LM lays out an embedding" in (root / "README.md").read_text()
