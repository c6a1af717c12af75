"""Models torch.export can trace only in part (``runtime/model/trace/eager.py``): DBRX, whose experts skip those that received
no tokens, and Gemma-3n's text model, whose layers make a tensor the trace cannot follow. PyTorch runs both, and so
does the lab: the untraceable modules run eagerly inside their units, and 2 stages with recompute and swap on those
units and a live boundary move train equal to one process (``tests/models/zoo.py``; docs/models.md)."""

from __future__ import annotations

import pytest

import vpipe_lab
from tests.models.zoo import ZOO, assert_equal_to_one_process
from vpipe_lab import Plan

pytestmark = [pytest.mark.slow, pytest.mark.models]

# (model, plan, the boundaries a live move takes at iteration 2, what runs eagerly by unit)
CASES = {
    "dbrx": (Plan((0, 3, 6), tuple("krskrk"), 2, "1f1b"), (0, 2, 6),
             {f"transformer.blocks.{i}": [f"transformer.blocks.{i}.ffn.experts"] for i in range(4)}),
    "gemma-3n": (Plan((0, 4, 8), tuple("kkrskkkk"), 2, "1f1b"), (0, 3, 8),
                 {f"model.layers.{i}": [f"model.layers.{i}"] for i in range(4)}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_model_traced_in_part_trains_equal_to_one_process_with_a_live_move(name: str) -> None:
    plan, moved, eager = CASES[name]
    entry = ZOO[name]
    with vpipe_lab.launch(entry.model, entry.data, stages=2, microbatches=2, plan=plan, optimizer=entry.optimizer,
                          device="cpu", timeout=120, start_timeout=300) as session:
        assert session.eager == eager and "units run in part eagerly" in repr(session)
        session.run(2)
        session.wait(timeout=300)
        assert session.set_partition(moved) == 2
        session.run(2)
        session.wait(timeout=300)
        assert session.last_migration["moves"] > 0 and session.plan.boundaries == moved
        losses = list(session.metrics.iterations["loss"])
        state = session.state_dict()
    assert_equal_to_one_process(name, losses, state, iterations=4, microbatches=2)
