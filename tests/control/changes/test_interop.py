"""A session's plan out and production configs in, without workers: what the lab measured per plan version, the
bundle with its prediction, every kind of source read as a plan, the comparison with the lab's plan, and a
checkpoint's units."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vpipe_lab.control.changes import interop
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.interop.bundle import UnitInfo
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.workloads import cluster, random_chain
from vpipe_lab.wire import bundle_files as files

UNITS = ([UnitInfo("embed", ("embed",), "pre")] + [UnitInfo(f"h{i}", (f"h.{i}",), "block:Block") for i in range(6)]
         + [UnitInfo("head", ("norm", "head"), "post")])
PLAN = Plan((0, 4, 8), ("keep",) * 8, 4)


def test_the_measured_time_is_the_plan_versions_median() -> None:
    records = [{"plan_version": 0, "time_s": t} for t in (1.0, 2.0, 3.0)] + [{"plan_version": 1, "time_s": 9.0}]
    assert interop.measured_s(records, 0) == 2.0 and interop.measured_s(records, 1) == 9.0
    assert interop.measured_s(records, 2) is None


def test_a_bundle_carries_the_prediction() -> None:
    profile = random_chain(8, seed=1)
    b = interop.bundle_of(PLAN, UNITS, microbatch_size=4, profile=profile, cluster=cluster("rtx2080ti", 2),
                          measured=0.5)
    assert b.predicted_s is not None and b.predicted_s > 0 and b.measured_s == 0.5 and b.microbatch_size == 4


def test_every_source_reads_as_a_plan(tmp_path: Path) -> None:
    assert interop.read("Et*3|t*3L", UNITS, PLAN).boundaries == (0, 4, 8)
    assert interop.read([["embed", "h.0", "h.1"], ["h.2", "h.3", "h.4", "h.5", "norm", "head"]], UNITS,
                        PLAN).boundaries == (0, 3, 8)
    par = {"pipeline_parallel_degree": 2, "module_fqns_per_model_part": [["embed", "h.0"], ["h.1", "h.2", "h.3"],
                                                                         ["h.4"], ["h.5", "norm", "head"]],
           "pipeline_parallel_schedule": "Interleaved1F1B"}
    assert interop.read(par, UNITS, PLAN).virtual_stages == 2
    root = files.write(tmp_path / "b", interop.bundle_of(Plan((0, 2, 8), ("keep",) * 8, 4), UNITS))
    assert interop.read(root, UNITS, PLAN).boundaries == (0, 2, 8)
    toml = tmp_path / "t.toml"
    toml.write_text((root / "torchtitan.toml").read_text().replace("# pipeline_parallel_microbatch_size",
                                                                   "pipeline_parallel_microbatch_size = 2\n#"))
    assert interop.read(toml, UNITS, PLAN, batch_size=8).boundaries == (0, 2, 8)
    # without a running plan, what the source leaves open is refused naming the keyword, never defaulted
    with pytest.raises(PlanError, match=r"does not say the number of micro-batches: give microbatches="):
        interop.import_plan("Et*3|t*3L", UNITS, ranks=2)
    with pytest.raises(PlanError, match=r"does not say how many ranks run its stages: give ranks="):
        interop.import_plan("Et*3|t*3L", UNITS, microbatches=2)
    with pytest.raises(PlanError, match=r"does not say the number of micro-batches"):
        interop.import_plan([["embed", "h.0"], ["h.1", "h.2", "h.3", "h.4", "h.5", "norm", "head"]], UNITS, ranks=2)
    with pytest.raises(PlanError, match=r"give microbatches= \(--microbatches\) or batch_size="):
        interop.import_plan(par, UNITS)
    assert interop.import_plan("Et*3|t*3L", UNITS, ranks=2, microbatches=3) == interop.read("Et*3|t*3L", UNITS, PLAN
                                                                                           ).replace(microbatches=3)
    assert interop.import_plan("Et*3|t*3L", root, microbatches=4).boundaries == (0, 4, 8)  # a bundle's units
    with pytest.raises(PlanError, match="cannot import int"):
        interop.read(3, UNITS, PLAN)


def test_the_comparison_says_what_the_lab_would_change() -> None:
    profile = random_chain(8, seed=3)
    lopsided = Plan((0, 1, 8), ("keep",) * 8, 8)
    found = interop.compare(lopsided, profile, cluster("rtx2080ti", 2))
    assert found.lab != lopsided and found.lab_s < found.imported_s and found.moves
    assert "faster" in found.describe() and found.gain > 0
    again = interop.compare(found.lab, profile, cluster("rtx2080ti", 2))
    assert again.lab == found.lab and "would keep this plan" in again.describe()


def test_a_checkpoint_names_its_units_or_says_it_cannot(tmp_path: Path) -> None:
    version = tmp_path / "ckpt-1"
    version.mkdir()
    (version / ".metadata").write_bytes(b"")
    doc = {"kind": "vpipe_lab-checkpoint", "version": 2, "iteration": 3, "plan": PLAN.to_dict(), "num_layers": 8,
           "names": [u.name for u in UNITS], "seed": 0, "format": "dcp", "units": [u.to_dict() for u in UNITS]}
    (version / "manifest.json").write_text(json.dumps(doc))
    plan, units = interop.from_checkpoint(version)
    assert plan == PLAN and units == UNITS
    (version / "manifest.json").write_text(json.dumps({**doc, "units": []}))
    with pytest.raises(PlanError, match="export from a running session"):
        interop.from_checkpoint(version)


def test_torchtitan_text_or_path_reads_its_local_batch_size(tmp_path: Path) -> None:
    """torchtitan's [training] local_batch_size decides the micro-batches (it was ignored: every such import failed),
    and TOML text is read as text however long (it was taken for a file name: 'File name too long')."""
    text = ("[training]\nlocal_batch_size = 8\n\n[parallelism]\npipeline_parallel_degree = 2\n"
            "pipeline_parallel_microbatch_size = 2\npipeline_parallel_schedule = \"1F1B\"\n"
            "module_fqns_per_model_part = [[\"embed\", \"h.0\", \"h.1\"], [\"h.2\", \"h.3\", \"h.4\", \"h.5\", \"norm\", "
            "\"head\"]]\n")
    long_text = text + "# " + "x" * 5000 + "\n"
    path = tmp_path / "job.toml"
    path.write_text(text)
    for source in (text, long_text, path, str(path)):
        plan = interop.import_plan(source, UNITS)
        assert (plan.microbatches, plan.boundaries, plan.schedule) == (4, (0, 3, 8), "1f1b")
    assert interop.import_plan(text, UNITS, batch_size=16).microbatches == 8  # the keyword overrides the config
    with pytest.raises(PlanError, match="gives no batch size"):
        interop.import_plan(text.replace("local_batch_size = 8\n", ""), UNITS)
