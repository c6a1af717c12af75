"""``pipeline.json``: torch stages over the model's own module names, read back checked, and module lists (as
torchtitan gives them) turned into a plan over the lab's units, with errors that name what does not fit."""

from __future__ import annotations

import pytest

from vpipe_lab.core.errors import PlanError, ProfileError
from vpipe_lab.core.interop.bundle import Bundle, UnitInfo, make, plan_from_parts
from vpipe_lab.core.plan import Plan, Policy

GPT2 = [UnitInfo("pre", ("transformer.wte", "transformer.wpe", "transformer.drop"), "pre")] + [
    UnitInfo(f"transformer.h.{i}", (f"transformer.h.{i}",), "block:GPT2Block") for i in range(4)] + [
    UnitInfo("transformer.ln_f+lm_head", ("transformer.ln_f", "lm_head"), "post", ("transformer.wte.weight",))]


def test_stages_name_modules_split_points_and_policies() -> None:
    plan = Plan((0, 2, 4, 6), tuple("kskrkk"), 3, "1f1b")
    b = make(plan, GPT2, microbatch_size=2)
    assert [s.split_at for s in b.stages] == [None, "transformer.h.1", "transformer.h.3"]
    assert b.stages[0].modules == ("transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0")
    assert b.stages[0].offload == ("transformer.h.0",) and b.stages[1].recompute == ("transformer.h.2",)
    assert b.stages[2].tensors == ("transformer.wte.weight",)  # the tied head's weight, owned by the embedding
    assert [s.rank for s in b.stages] == [0, 1, 2] and b.schedule == "1F1B"
    again = Bundle.from_dict(b.to_dict())
    assert again == b


def test_v_placement_and_notes() -> None:
    plan = Plan((0, 1, 3, 5, 6), tuple("kkkkkk"), 2, "zbv", 2)
    b = make(plan, GPT2)
    assert [s.rank for s in b.stages] == [0, 1, 1, 0] and b.style == "v"
    assert b.schedule is None and "2 x stages - 1" in b.notes[0]  # M = 2 < 2K - 1: torch's order differs; the CSV


def test_what_cannot_be_exported_is_refused_by_name() -> None:
    with pytest.raises(PlanError, match="pipedream-flush"):
        make(Plan((0, 3, 6), tuple("kkkkkk"), 4, "pipedream"), GPT2)
    glue = [*GPT2[:3], UnitInfo("(glue)"), *GPT2[4:]]
    with pytest.raises(PlanError, match=r"run no module of their own.*split="):
        make(Plan((0, 3, 6), tuple("kkkkkk"), 4), glue)
    doc = make(Plan((0, 3, 6), tuple("kkkkkk"), 4), GPT2).to_dict()
    doc["stages"][1]["units"] = [2, 3, 4, 5]
    with pytest.raises(ProfileError, match="do not match its plan"):
        Bundle.from_dict(doc)
    with pytest.raises(ProfileError, match="format 7"):
        Bundle.from_dict({**doc, "format": 7})


def test_module_lists_become_a_plan() -> None:
    parts = [["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0"],
             ["transformer.h.1", "transformer.h.2"], ["transformer.h.3", "transformer.ln_f", "lm_head"]]
    plan = plan_from_parts(parts, GPT2, microbatches=4, schedule="1f1b")
    assert plan.boundaries == (0, 2, 4, 6)
    whole = plan_from_parts([["transformer"], ["lm_head"]], [*GPT2[:5], UnitInfo("x", ("transformer.ln_f",), "post"),
                                                            UnitInfo("y", ("lm_head",), "post")],
                            microbatches=2, schedule="gpipe")
    assert whole.boundaries == (0, 6, 7)  # a parent module names every unit below it


@pytest.mark.parametrize(("parts", "message"), [
    ([["transformer.wte"], ["transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
                            "transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]], "splits unit 0"),
    ([["transformer.wte", "transformer.wpe", "transformer.drop"], ["transformer.h.0"]], "no part .* names unit 2"),
    ([["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
       "transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head", "decoder.x"]], r"names \['decoder.x'\]"),
    ([["transformer.h.0", "transformer.h.1", "transformer.h.2", "transformer.h.3"],
      ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.ln_f", "lm_head"]], "consecutive units"),
])
def test_module_lists_that_do_not_fit_are_named(parts: list[list[str]], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan_from_parts(parts, GPT2, microbatches=4, schedule="1f1b")


def test_unit_info_round_trip_and_block_class() -> None:
    u = GPT2[1]
    assert UnitInfo.from_dict(u.to_dict()) == u and u.block_class == "GPT2Block"
    assert GPT2[0].block_class is None and GPT2[-1].block_class is None
    assert Policy.RECOMPUTE.value == "recompute"


def test_a_cut_between_calls_of_one_module_cannot_be_exported() -> None:
    units = [UnitInfo("embed", ("embed",), "pre"), UnitInfo("g", ("enc.group",), "block:G"),
             UnitInfo("g@1", ("enc.group@1",), "block:G"), UnitInfo("head", ("head",), "post")]
    with pytest.raises(PlanError, match="split at modules, not at calls"):
        make(Plan((0, 2, 4), ("keep",) * 4, 2), units)
