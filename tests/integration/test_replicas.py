"""Data parallelism over pipeline replicas (``replicas=R``: R x S worker processes) against one process over the
global batch with R x M micro-batches."""

from __future__ import annotations

import pytest

import vpipe_lab
from tests.runtime import reference
from vpipe_lab import Plan
from vpipe_lab.examples import gpt, mlp

pytestmark = pytest.mark.slow


def test_two_replicas_of_two_stages_match_one_process_across_a_migration() -> None:
    """SGD with momentum, 2 replicas x 2 stages (4 processes), 2 micro-batches each: every loss and parameter equals
    plain PyTorch over the global batch in 4 micro-batches, also after a plan change that migrates layers (with
    their momentum) on both replicas at the same iteration and switches the schedule from zb-h1 (split backward) to
    1F1B."""
    with vpipe_lab.launch("mlp", stages=2, replicas=2, microbatches=2, schedule="zb-h1", device="cpu",
                          timeout=60) as session:
        assert session.plan.devices == 4
        session.run(2)
        session.wait(timeout=120)
        session.apply(Plan((0, 3, 10), ("keep",) * 5 + ("recompute",) * 5, 2, "1f1b"))
        session.run(2)
        session.wait(timeout=120)
        frame = session.metrics.iterations
        per_replica = session.metrics.replicas
        state = session.state_dict()
    model, losses = reference.train(mlp.model, mlp.data, mlp.loss, mlp.optimizer, iterations=4, microbatches=4)
    assert list(frame["loss"]) == pytest.approx(losses, rel=1e-5)
    assert list(frame["samples"]) == [mlp.BATCH] * 4  # the global batch, over both replicas
    assert sorted(set(per_replica["replica"])) == [0, 1] and list(per_replica["samples"]) == [mlp.BATCH // 2] * 8
    mean = per_replica.groupby("iteration")["loss"].mean()
    assert list(mean) == pytest.approx(losses, rel=1e-5)  # each replica's own loss, and the total is their mean
    reference.assert_state_matches(state, model)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_replicated_gpt_with_ties_dropout_and_global_clipping(schedule: str) -> None:
    """gpt-tiny (dropout, embedding tied to the LM head) in 2 replicas with clip_grad_norm, each replica over two
    chunks per stage (interleaved: the tie across stages; ZBV: both ends on stage 0, which also computes the loss):
    each replica's micro-batches draw the global batch's dropout masks, tied gradients are reduced inside each
    replica, and the clipping norm is the whole model's over the global batch."""
    plan = Plan((0, 2, 4, 6, 8), ("keep",) * 8, 2, schedule, 2)
    with vpipe_lab.launch("gpt-tiny", stages=2, replicas=2, microbatches=2, plan=plan, clip_grad_norm=0.5,
                          schedule=schedule, virtual_stages=2, device="cpu", timeout=90) as session:
        session.run(2)
        session.wait(timeout=180)
        frame = session.metrics.iterations
        state = session.state_dict()
    norms: list[float] = []
    model, losses = reference.train(gpt.model, gpt.data, gpt.loss, gpt.optimizer, iterations=2, microbatches=4,
                                    clip=0.5, norms=norms)
    assert list(frame["loss"]) == pytest.approx(losses, rel=1e-5)
    assert list(frame["grad_norm"]) == pytest.approx(norms, rel=1e-4)
    reference.assert_state_matches(state, model)


def test_bad_replica_counts_are_refused() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="replicas"):
            vpipe_lab.launch("mlp", stages=2, replicas=bad, microbatches=2, device="cpu")  # type: ignore[arg-type]
