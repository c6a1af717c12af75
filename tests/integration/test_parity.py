"""A pipelined run must match plain single-process PyTorch training (same seed, micro-batches, accumulation)."""

from __future__ import annotations

import pytest
import torch

import vpipe_lab
from tests.runtime import reference
from vpipe_lab import Plan
from vpipe_lab.core.plan import SCHEDULES
from vpipe_lab.examples import gpt, mlp

pytestmark = pytest.mark.slow

POLICIES = {
    "keep": "k" * 10,
    "recompute": "r" * 10,
    "swap": "s" * 10,
    "mixed": "ksrrskksrk",
}


def assert_matches(state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    assert list(state) == list(model.state_dict())  # every tensor, in the model's order
    reference.assert_state_matches(state, model)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_two_stages_match_plain_pytorch(schedule: str, policy: str) -> None:
    plan = Plan((0, 4, 10), tuple(POLICIES[policy]), 4, schedule)
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, schedule=schedule, plan=plan, device="cpu",
                          timeout=60) as session:
        session.run(3)
        session.wait(timeout=120)
        losses = list(session.metrics.iterations["loss"])
        state = session.state_dict()
    model, ref_losses = reference.train(mlp.model, mlp.data, mlp.loss, mlp.optimizer, iterations=3, microbatches=4)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_matches(state, model)


@pytest.mark.parametrize("schedule", ["1f1b", "eager-1f1b"])
def test_four_stages_with_dropout_match_plain_pytorch(schedule: str) -> None:
    """gpt-tiny has dropout: recompute must replay the same masks, and layer seeding must not depend on the stage."""
    policies = ("keep", "recompute", "swap", "keep", "recompute", "swap", "keep", "keep")
    plan = Plan((0, 2, 4, 6, 8), policies, 4, schedule)
    with vpipe_lab.launch("gpt-tiny", stages=4, microbatches=4, schedule=schedule, plan=plan, device="cpu",
                          timeout=90) as session:
        session.run(2)
        session.wait(timeout=180)
        state = session.state_dict()
    model, _ = reference.train(gpt.model, gpt.data, gpt.loss, gpt.optimizer, iterations=2, microbatches=4)
    assert_matches(state, model)
