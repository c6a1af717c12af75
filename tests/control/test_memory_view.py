"""session.memory(): each stage's predicted peak beside what the allocator held, on real workers."""

from __future__ import annotations

import pytest

import vpipe_lab
from vpipe_lab import Plan

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_each_stage_s_predicted_peak_stands_beside_the_allocator_s(policy: str) -> None:
    plan = Plan((0, 4, 8), (policy,) * 8, 4, "1f1b")
    with vpipe_lab.launch("gpt-tiny", stages=2, microbatches=4, device="cpu", timeout=60, plan=plan) as session:
        session.run(6)
        session.wait(timeout=120)
        frame = session.memory()
    assert list(frame["stage"]) == [0, 1] and frame["allocated_peak"].notna().all(), frame.T
    # the measurement is the allocator's, not the ledger's count the prediction is built from
    assert (frame["allocated_peak"] != frame["counted_peak"]).all(), frame.T
    assert (frame["error"].abs() < 0.10).all(), frame.T
