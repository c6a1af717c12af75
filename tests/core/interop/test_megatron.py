"""Megatron-LM's pipeline layout string for a plan, read by megatron-core's own parser, and layout strings read
back into plans over the lab's units."""

from __future__ import annotations

import megatron.core.transformer.pipeline_parallel_layer_layout as layout_mod
import pytest
from megatron.core.transformer.enums import LayerType

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.interop import megatron
from vpipe_lab.core.interop.bundle import UnitInfo, make
from vpipe_lab.core.plan import Plan

UNITS = ([UnitInfo("embed", ("model.embed_tokens",), "pre")]
         + [UnitInfo(f"layer{i}", (f"model.layers.{i}",), "block:LlamaDecoderLayer") for i in range(6)]
         + [UnitInfo("head", ("model.norm", "lm_head"), "post")])


@pytest.mark.parametrize(("plan", "text"), [
    (Plan((0, 3, 8), tuple("k" * 8), 4), "Ett|t*4L"),
    (Plan((0, 2, 4, 6, 8), tuple("k" * 8), 4, "interleaved-1f1b", 2), "Et|tt|tt|tL"),
])
def test_layouts_megatron_core_reads_as_the_plan(plan: Plan, text: str) -> None:
    got = megatron.layout(plan, UNITS)
    assert got == text
    parsed = layout_mod.PipelineParallelLayerLayout(got, plan.stages)  # megatron-core's own parser and checks
    parsed.validate_layer_layout(num_layers=6, mtp_num_layers=None)
    assert parsed.virtual_pipeline_model_parallel_size == plan.virtual_stages
    for rank in range(plan.stages):  # what megatron-core builds on each rank and virtual stage is the plan's chunk
        for v in range(plan.virtual_stages):
            chunk = v * plan.stages + rank
            kinds = [UNITS[i].kind.split(":")[0] for i in plan.chunk_layers(chunk)]
            expected = [{"pre": LayerType.embedding, "block": LayerType.decoder, "post": LayerType.loss}[k]
                        for k in kinds]
            assert parsed.layout[rank][v] == expected
    back = megatron.plan_from_layout(got, plan.stages, UNITS, microbatches=4)
    assert back.boundaries == plan.boundaries and back.virtual_stages == plan.virtual_stages


def test_our_parser_reads_what_megatron_core_reads() -> None:
    for text in ("Et*3|(tt|)*1,tL", "E|t*6|L", "(Ett|)*1tt|ttL"):
        ours = megatron.parse(text)
        theirs = layout_mod.PipelineParallelLayerLayout.parse_str_to_list(text)
        assert [len(s) for s in ours] == [len(s) for s in theirs], text


def test_recompute_flags_say_what_megatron_can() -> None:
    firsts = Plan((0, 4, 8), tuple("krrkrrkk"), 4)  # the first 2 blocks of each stage
    args, missing = megatron.recompute_args(firsts, UNITS)
    assert args == ["--recompute-granularity full", "--recompute-method block", "--recompute-num-layers 2"]
    assert not missing
    scattered = Plan((0, 4, 8), tuple("kkrkskrk"), 4)
    args, missing = megatron.recompute_args(scattered, UNITS)
    assert args == [] and "recompute layer1" in missing and "swap layer3" in missing


def test_bundles_get_megatron_args_and_what_megatron_cannot_is_said() -> None:
    text = megatron.args_text(make(Plan((0, 3, 8), tuple("k" * 8), 4, "zb-h1"), UNITS, microbatch_size=2))
    assert '--pipeline-model-parallel-layout "Ett|t*4L"' in text and "--micro-batch-size 2" in text
    assert "runs 1F1B where the lab ran zb-h1" in text
    with pytest.raises(PlanError, match="V placement"):
        megatron.layout(Plan((0, 2, 4, 6, 8), tuple("k" * 8), 4, "zbv", 2), UNITS)
    with pytest.raises(PlanError, match="this model's units are"):
        megatron.layout(Plan((0, 1, 2), tuple("kk"), 2), [UnitInfo("a", ("a",)), UnitInfo("b", ("b",))])
    for bad, message in (("Et|tL", "has 2 transformer layers"), ("tE|t*5L", "begin with the embedding"),
                         ("Et*3|t*3X", "characters"), ("Et*6||L", "empty stage")):
        with pytest.raises(PlanError, match=message):
            megatron.plan_from_layout(bad, 1 if bad.count("|") == 0 else bad.count("|") + 1, UNITS, microbatches=2)


def test_a_sharded_plan_says_its_data_parallel_size_and_takes_the_distributed_optimizer() -> None:
    plan = Plan((0, 3, 8), tuple("k" * 8), 4, "1f1b", shards=4, replicas=2)
    text = megatron.args_text(make(plan, UNITS, microbatch_size=2))
    assert "--use-distributed-optimizer" in text and "data-parallel size 8: launch 16 ranks" in text
    assert "--use-distributed-optimizer" not in megatron.args_text(make(Plan((0, 3, 8), tuple("k" * 8), 4), UNITS))
