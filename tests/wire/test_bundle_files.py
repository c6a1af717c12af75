"""The export bundle on disk: every file written, read back checked, moved into place whole, never over a directory
that is not a bundle."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from vpipe_lab.core.errors import ProfileError
from vpipe_lab.core.interop.bundle import UnitInfo, make
from vpipe_lab.core.plan import Plan
from vpipe_lab.wire import bundle_files as bundle

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


def test_a_directory_with_anything_beside_a_bundle_is_never_replaced(tmp_path: Path) -> None:
    """docs/security.md: export replaces only a bundle holding nothing but bundle files."""
    first = make(Plan((0, 3, 6), tuple("kkkkkk"), 4), UNITS)
    cases = {
        "notes": lambda d: (bundle.write(d, first), (d / "notes.txt").write_text("precious")),
        "any pipeline.json": lambda d: (d.mkdir(), (d / "pipeline.json").write_text("{}"),
                                        (d / "data.csv").write_text("precious")),
        "a sub-directory": lambda d: (bundle.write(d, first), (d / "runs").mkdir(), (d / "runs" / "x").write_text("1")),
    }
    for name, make_dir in cases.items():
        target = tmp_path / name.replace(" ", "_")
        make_dir(target)
        before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
        with pytest.raises(FileExistsError) as info:
            bundle.write(target, first)
        assert "\n" not in str(info.value) and "give a new or empty directory" in str(info.value), name
        assert {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()} == before, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_sub-directory", "any_pipeline.json", "notes"]
    (tmp_path / "empty").mkdir()
    assert bundle.read(bundle.write(tmp_path / "empty", first)) == first  # an empty directory is taken


def test_a_pipeline_json_that_is_not_a_small_file_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "pipeline.json").symlink_to("/dev/zero")
    with pytest.raises(ProfileError, match="not a regular file"):
        bundle.read(tmp_path / "b")
    with pytest.raises(FileExistsError, match="not an export bundle"):
        bundle.write(tmp_path / "b", make(Plan((0, 3, 6), tuple("kkkkkk"), 4), UNITS))


def test_a_model_megatron_cannot_lay_out_gets_the_reason_in_its_readme(tmp_path: Path) -> None:
    units = [UnitInfo(str(i), (str(i),), "block:Linear") for i in range(4)]
    root = bundle.write(tmp_path / "b", make(Plan((0, 2, 4), tuple("kkkk"), 2), units))
    assert not (root / "megatron.args").exists()
    assert "No `megatron.args`: Megatron-LM lays out an embedding" in (root / "README.md").read_text()


def _doc() -> dict:
    b = make(Plan((0, 3, 6), tuple("kkrkks"), 4, "1f1b"), UNITS, microbatch_size=2)
    return b.to_dict()


def _edit(doc: dict, path: str, value: object) -> dict:
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[int(last) if last.isdigit() else last] = value
    return doc


@pytest.mark.parametrize(("field", "value", "said"), [
    ("vpipe_lab.units", None, "vpipe_lab.units: None is not of type 'array'"),
    ("stages", None, "stages: None is not of type 'array'"),
    ("vpipe_lab.notes", 5, "vpipe_lab.notes: 5 is not of type 'array'"),
    ("schedule_csv", "../../../outside.csv", "schedule_csv: '../../../outside.csv' does not match"),
    ("schedule_csv", "/etc/passwd", "schedule_csv: '/etc/passwd' does not match"),
    ("vpipe_lab.plan.microbatches", 10**12, "vpipe_lab.plan.microbatches: 1000000000000 is greater than the maximum"),
    ("microbatches", 0, "microbatches: 0 is less than the minimum of 1"),
    ("microbatch_size", -3, "microbatch_size: -3 is less than the minimum of 1"),
    ("stages.0.rank", "0", "stages[0].rank: '0' is not of type 'integer'"),
    ("vpipe_lab.units.1.moe", [{"module": "m", "experts": 0}], "vpipe_lab.units[1].moe[0].experts: 0 is less"),
    ("vpipe_lab.plan.policies.0", "maybe", "vpipe_lab.plan.policies[0]: 'maybe' is not one of"),
    ("kind", [], "kind: 'vpipe_lab-pipeline' was expected"),
])
def test_a_bundle_the_contract_does_not_admit_is_refused_in_one_line_naming_the_field(
        tmp_path: Path, field: str, value: object, said: str) -> None:
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(_edit(_doc(), field, value)))
    with pytest.raises(ProfileError) as caught:
        bundle.read(path)
    assert said in str(caught.value) and "\n" not in str(caught.value)
    assert [p.name for p in tmp_path.iterdir()] == ["pipeline.json"]  # nothing written anywhere


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"format": 1' + "0" * 5000 + "}", "\udcff",
                                  '{"kind": "vpipe_lab-pipeline", "format": 1, "stages": ' + "[" * 900 + "]" * 900 + "}"])
def test_a_bundle_nested_past_the_parser_or_with_huge_numbers_is_refused_not_crashed(tmp_path: Path, text: str) -> None:
    path = tmp_path / "pipeline.json"
    path.write_text(text, errors="surrogateescape")
    with pytest.raises(ProfileError, match=r"pipeline\.json"):
        bundle.read(path)


def test_the_core_reader_refuses_the_same_without_jsonschema() -> None:
    """Bundle.from_dict (the pure core, no jsonschema) holds the checks the lab relies on by itself."""
    from vpipe_lab.core.interop.bundle import Bundle

    for field, value, said in [("vpipe_lab.units", None, "vpipe_lab.units must be a list"),
                               ("schedule_csv", "../x.csv", "schedule_csv must be a plain file name"),
                               ("vpipe_lab.plan.microbatches", 10**12, "microbatches must be a whole number from 1"),
                               ("vpipe_lab.units.0.kind", 5, "vpipe_lab.units[0].kind must be")]:
        with pytest.raises(ProfileError, match=re.escape(said)):
            Bundle.from_dict(_edit(_doc(), field, value))


def test_every_bundle_written_keeps_the_schema_and_docs_interop_documents_every_field(tmp_path: Path) -> None:
    import jsonschema

    from vpipe_lab.core.interop.bundle import SCHEMA_FILE

    schema = json.loads(SCHEMA_FILE.read_text())
    root = bundle.write(tmp_path / "b", make(Plan((0, 2, 4, 6), tuple("kkrksk"), 6, "zb-h1"), UNITS,
                                             microbatch_size=1, predicted_s=0.2))
    jsonschema.Draft202012Validator(schema).validate(json.loads((root / "pipeline.json").read_text()))
    # write() validates what it writes, so a Bundle that breaks the contract never reaches the disk
    bad = make(Plan((0, 3, 6), tuple("kkkkkk"), 4), UNITS)
    object.__setattr__(bad, "schedule_csv", "../escape.csv")
    with pytest.raises(ProfileError, match="schedule_csv"):
        bundle.write(tmp_path / "bad", bad)
    assert not (tmp_path / "escape.csv").exists() and not (tmp_path / "bad").exists()
    docs = (Path(__file__).parents[2] / "docs" / "interop.md").read_text()
    fields = set(schema["properties"]) | {k for d in schema["$defs"].values() for k in d.get("properties", {})}
    undocumented = sorted(f for f in fields if f"`{f}`" not in docs)
    assert not undocumented, f"docs/interop.md does not document {undocumented}"
    described = [(name, k) for name, d in [("top", schema), *schema["$defs"].items()]
                 for k, v in d.get("properties", {}).items() if "description" not in v and "$ref" not in v
                 and k not in ("kind", "version")]
    assert not described, f"schema fields without a description: {described}"
