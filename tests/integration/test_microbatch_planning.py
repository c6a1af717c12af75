"""The micro-batch count as a planned dimension on a live run: the profiler measures the throughput-vs-size curve,
the planner chooses a count for the same global batch, and a new count is applied at the next iteration."""

from __future__ import annotations

import pytest

import vpipe_lab
from tests.runtime import reference
from vpipe_lab import Plan
from vpipe_lab.core.cost import scaling
from vpipe_lab.examples import mlp

pytestmark = pytest.mark.slow


def test_measured_curve_replan_and_a_live_change_of_microbatch_count() -> None:
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60) as session:
        session.run(4)
        session.wait(timeout=120)
        profile = session.profile()
        assert profile.microbatch_size == mlp.BATCH // 4
        assert all([t[0] for t in layer.times] == [4, 16] for layer in profile.layers)  # half and twice 8
        curve = scaling.throughput_curve(profile, scaling.measured_sizes(profile))
        assert [b for b, _ in curve] == [4, 8, 16] and all(rate > 0 for _, rate in curve)
        found = session.replan(choose_microbatches=True)
        assert found.plan.microbatches * found.profile.microbatch_size == mlp.BATCH  # type: ignore[union-attr]
        # A change of micro-batch count is a plan change like any other: at the next iteration, nothing lost.
        at = session.apply(Plan((0, 4, 10), ("keep",) * 10, 2, "1f1b"))
        assert at == 4
        session.run(3)
        session.wait(timeout=120)
        frame = session.metrics.iterations
        state = session.state_dict()
    assert list(frame["microbatches"]) == [4] * 4 + [2] * 3
    # The mean of equal micro-batches' mean losses is the batch's mean: the same training as plain PyTorch
    model, losses = reference.train(mlp.model, mlp.data, mlp.loss, mlp.optimizer, iterations=7, microbatches=4)
    assert list(frame["loss"]) == pytest.approx(losses, rel=1e-5)
    reference.assert_state_matches(state, model)
