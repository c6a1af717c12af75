"""Mixtures of experts in the pipeline (transformers' Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, Qwen2-MoE, GPT-OSS and
Llama 4's text model): each is cut into a unit per decoder layer (its experts) and trains equal to one process, with its
own optimizer, on 2-4 stages under 1F1B, interleaved 1F1B and the zero-bubble schedules, with keep, recompute and swap
on expert layers and a live boundary move that migrates expert layers while training goes on (``tests/models/zoo.py``;
docs/models.md). One run per family covers what a separate 2-stage run of each did too (the default cut's units, its
parity), so the matrix is the test (issue #59: the suite within 15 minutes)."""

from __future__ import annotations

import pytest

import vpipe_lab
from tests.models.zoo import ZOO, assert_equal_to_one_process
from vpipe_lab import Plan

pytestmark = [pytest.mark.slow, pytest.mark.models]
MOE = [n for n, e in ZOO.items() if e.family == "mixture of experts"]


# (model, plan, the boundaries a live move takes at iteration 2): units are 0 embedding, 1-4 the decoder layers (their
# experts), 5 the head. Each schedule and stage count on another family; policies k(eep), r(ecompute), s(wap).
CASES = {
    "mixtral-1f1b-4-stages": ("mixtral", Plan((0, 2, 3, 4, 6), tuple("krsrkk"), 4, "1f1b"), (0, 1, 2, 4, 6)),
    "qwen3-moe-interleaved": ("qwen3-moe", Plan((0, 2, 3, 4, 6), tuple("ksrkkk"), 4, "interleaved-1f1b", 2),
                              (0, 1, 3, 5, 6)),
    "deepseek-v3-zb-h1-3-stages": ("deepseek-v3", Plan((0, 2, 4, 6), tuple("krskrk"), 4, "zb-h1"), (0, 3, 5, 6)),
    "olmoe-zbv": ("olmoe", Plan((0, 2, 3, 4, 6), tuple("kkrskk"), 4, "zbv", 2), (0, 1, 3, 4, 6)),
    "qwen2-moe-1f1b-3-stages": ("qwen2-moe", Plan((0, 2, 4, 6), tuple("kssrrk"), 4, "1f1b"), (0, 1, 4, 6)),
    "gpt-oss-zb-h1": ("gpt-oss", Plan((0, 3, 6), tuple("krkskk"), 4, "zb-h1"), (0, 4, 6)),
    "llama4-interleaved": ("llama4", Plan((0, 2, 3, 5, 6), tuple("krskkk"), 4, "interleaved-1f1b", 2),
                           (0, 1, 3, 4, 6)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_schedules_policies_and_a_live_move_of_expert_layers_match_one_process(case: str) -> None:
    name, plan, moved = CASES[case]
    entry = ZOO[name]
    with vpipe_lab.launch(entry.model, entry.data, stages=plan.stages, microbatches=plan.microbatches,
                          schedule=plan.schedule, virtual_stages=plan.virtual_stages, plan=plan,
                          optimizer=entry.optimizer, device="cpu", timeout=120, start_timeout=300) as session:
        assert session.names[1:5] == [f"model.layers.{i}" for i in range(4)]  # every decoder layer (its experts) a unit
        session.run(2)
        session.wait(timeout=300)
        assert session.set_partition(moved) == 2
        session.run(2)
        session.wait(timeout=300)
        assert session.last_migration["moves"] > 0
        assert session.plan.boundaries == moved and session.plan.policies == plan.policies
        losses = list(session.metrics.iterations["loss"])
        state = session.state_dict()
    assert set(CASES[c][0] for c in CASES) == set(MOE)  # every family has its case
    assert_equal_to_one_process(name, losses, state, iterations=4, microbatches=4)
