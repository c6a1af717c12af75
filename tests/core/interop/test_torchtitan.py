"""torchtitan's settings from a bundle, checked by torchtitan's own config classes and plan generator, and
torchtitan configs read back into plans over the lab's units."""

from __future__ import annotations

import math
import tomllib
import types

import pytest
import torchtitan.config.configs as configs
from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.interop import torch_schedules, torchtitan
from vpipe_lab.core.interop.bundle import UnitInfo, make
from vpipe_lab.core.plan import Plan, Policy


def titan_units(layers: int) -> list[UnitInfo]:
    """A torchtitan-shaped model's units: embedding, ``layers.i`` blocks, norm and output."""
    return ([UnitInfo("tok_embeddings", ("tok_embeddings",), "pre")]
            + [UnitInfo(f"layers.{i}", (f"layers.{i}",), "block:TransformerBlock") for i in range(layers)]
            + [UnitInfo("norm+lm_head", ("norm", "lm_head"), "post")])


def test_the_toml_is_torchtitans_parallelism_config() -> None:
    plan = Plan((0, 2, 4, 6), (Policy.KEEP, *(Policy.RECOMPUTE,) * 4, Policy.KEEP), 6, "1f1b")
    b = make(plan, titan_units(4), microbatch_size=4)
    doc = tomllib.loads(torchtitan.toml_text(b, "/x/schedule.csv"))
    config = configs.ParallelismConfig(**doc["parallelism"])  # torchtitan's own dataclass: unknown keys fail here
    assert config.pipeline_parallel_degree == 3 and config.pipeline_parallel_schedule == "1F1B"
    assert config.pipeline_parallel_schedule_csv == "" and config.pipeline_parallel_microbatch_size == 4
    assert config.module_fqns_per_model_part == [["tok_embeddings", "layers.0"], ["layers.1", "layers.2"],
                                                 ["layers.3", "norm", "lm_head"]]
    assert doc["activation_checkpoint"]["mode"] == "full"  # every block recomputed: torchtitan's full AC


def test_a_csv_plan_keeps_its_placement_class_and_says_what_torchtitan_cannot() -> None:
    plan = Plan((0, 1, 3, 5, 6), tuple("kkskkk"), 2, "zbv", 2)
    b = make(plan, titan_units(4))
    assert b.schedule is None
    text = torchtitan.toml_text(b, "/bundle/schedule.csv")
    par = tomllib.loads(text)["parallelism"]
    assert par["pipeline_parallel_schedule"] == "ZBVZeroBubble"  # torchtitan places V stages by this name
    assert par["pipeline_parallel_schedule_csv"] == "/bundle/schedule.csv"
    assert "offload layers.1" in text and "no activation offloading" in text
    assert "pipeline_parallel_microbatch_size" not in par and "batch size / 2" in text


def test_the_python_config_applies_to_torchtitans_config_objects() -> None:
    plan = Plan((0, 3, 6), tuple("kkkkkk"), 4, "gpipe")
    source = torchtitan.python_text(make(plan, titan_units(4), microbatch_size=2), "/b/schedule.csv")
    space: dict[str, object] = {}
    exec(compile(source, "torchtitan_config.py", "exec"), space)
    config = types.SimpleNamespace(parallelism=configs.ParallelismConfig(), activation_checkpoint="untouched")
    space["apply"](config)  # type: ignore[operator]
    assert config.parallelism.pipeline_parallel_schedule == "GPipe"
    assert config.parallelism.module_fqns_per_model_part[1] == ["layers.2", "layers.3", "norm", "lm_head"]
    assert config.activation_checkpoint is None


@pytest.mark.parametrize("layers", [4, 6, 9])
@pytest.mark.parametrize("per_stage", [None, 2, 3])
@pytest.mark.parametrize("degree", [2, 3])
def test_layers_per_stage_places_as_torchtitan_does(layers: int, per_stage: int | None, degree: int) -> None:
    units = titan_units(layers)
    name = "1F1B" if per_stage is None else "Interleaved1F1B"
    stages = degree if per_stage is None else math.ceil((layers + 2) / per_stage)
    par = {"pipeline_parallel_degree": degree, "pipeline_parallel_schedule": name,
           "pipeline_parallel_layers_per_stage": per_stage}
    try:
        theirs = _generate_llm_fqn_per_model_part(stages, layers, 1, 1)
    except ValueError:
        theirs = None
    if theirs is None or stages % degree or (per_stage is not None and stages // degree < 2):
        with pytest.raises(PlanError):
            torchtitan.read(par, units, microbatches=degree * 2)
        return
    ours = torchtitan.read(par, units, microbatches=degree * 2)
    counts = [len([m for m in part if m.startswith("layers.")]) for part in theirs]
    assert [len([i for i in ours.chunk_layers(c) if units[i].kind.startswith("block")])
            for c in range(ours.chunks)] == counts


def test_schedules_map_to_the_lab_or_are_refused_with_the_closest() -> None:
    units = titan_units(4)
    parts = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "lm_head"]]
    par = {"pipeline_parallel_degree": 2, "module_fqns_per_model_part": parts,
           "pipeline_parallel_microbatch_size": 2}
    plan = torchtitan.read({**par, "pipeline_parallel_schedule": "Interleaved1F1B"}, units, batch_size=8)
    assert (plan.schedule, plan.virtual_stages, plan.microbatches) == ("interleaved-1f1b", 2, 4)
    assert torchtitan.read({**par, "pipeline_parallel_schedule": "ZBVZeroBubble"}, units, batch_size=8).schedule == "zbv"
    dual = torchtitan.read({**par, "pipeline_parallel_schedule": "DualPipeV"}, units, batch_size=8)
    assert (dual.schedule, dual.virtual_stages, dual.placement) == ("dualpipev", 2, (0, 1, 1, 0))
    with pytest.raises(PlanError, match="closest schedule is 'interleaved-1f1b'"):
        torchtitan.read({**par, "pipeline_parallel_schedule": "LoopedBFS"}, units, batch_size=8)
    with pytest.raises(PlanError, match="batch_size="):
        torchtitan.read({**par, "pipeline_parallel_schedule": "ZBVZeroBubble"}, units)
    with pytest.raises(PlanError, match="unknown pipeline_parallel_schedule"):
        torchtitan.read({**par, "pipeline_parallel_schedule": "Zigzag"}, units, batch_size=8)


def test_a_csv_is_read_as_the_lab_schedule_it_runs() -> None:
    units = titan_units(2)
    eager = Plan((0, 2, 4), tuple("kkkk"), 4, "eager-1f1b")
    par = {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule": "1F1B",
           "pipeline_parallel_schedule_csv": "x.csv", "module_fqns_per_model_part": [["tok_embeddings", "layers.0"],
                                                                                      ["layers.1", "norm", "lm_head"]]}
    got = torchtitan.read(par, units, microbatches=4, csv_text=torch_schedules.csv_text(eager))
    assert got == eager
    with pytest.raises(PlanError, match="none of the lab's schedules"):
        torchtitan.read(par, units, microbatches=4, csv_text="0F0,0F1\n1F0,1F1\n")
    toml = ('[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "GPipe"\n'
            'module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]]\n'
            'pipeline_parallel_microbatch_size = 2\n[training]\nlocal_batch_size = 8\n'
            '[activation_checkpoint]\nmode = "full"\n')
    read = torchtitan.read_toml(toml, units)
    assert (read.schedule, read.microbatches, read.boundaries) == ("gpipe", 4, (0, 2, 4))
    assert [p.value for p in read.policies] == ["keep", "recompute", "recompute", "keep"]


def test_a_sharded_plans_mesh_is_torchtitans_data_parallel_degrees_and_reads_back() -> None:
    """2 stages x 4 shards x 2 replicas: torchtitan's own ParallelismConfig takes the degrees and the reshard policy;
    read back, the plan is on the same mesh."""
    for sharding, policy, back in ((("regather", "stream"), "always", ("regather", "regather")),
                                   (("hold", "scatter"), "never", ())):
        plan = Plan((0, 3, 6), ("keep",) * 6, 4, "1f1b", shards=4, replicas=2, sharding=sharding)
        doc = tomllib.loads(torchtitan.toml_text(make(plan, titan_units(4), microbatch_size=2), "/x/schedule.csv"))
        config = configs.ParallelismConfig(**doc["parallelism"])
        assert (config.pipeline_parallel_degree, config.data_parallel_shard_degree,
                config.data_parallel_replicate_degree, config.fsdp_reshard_after_forward) == (2, 4, 2, policy)
        again = torchtitan.read(doc["parallelism"], titan_units(4), microbatches=4)
        assert (again.shards, again.replicas, tuple(m.value for m in again.sharding)) == (4, 2, back)
    whole = tomllib.loads(torchtitan.toml_text(make(Plan((0, 3, 6), ("keep",) * 6, 4), titan_units(4)), "/x.csv"))
    assert whole["parallelism"]["data_parallel_shard_degree"] == 1 and "fsdp_reshard_after_forward" not in whole[
        "parallelism"]
    assert torchtitan.read({"data_parallel_shard_degree": -1}, titan_units(4), microbatches=4).shards == 1
    with pytest.raises(PlanError, match="fsdp_reshard_after_forward must be"):
        torchtitan.read({"fsdp_reshard_after_forward": "sometimes"}, titan_units(4), microbatches=4)
    with pytest.raises(PlanError, match="data_parallel_shard_degree"):
        torchtitan.read({"data_parallel_shard_degree": 0}, titan_units(4), microbatches=4)
