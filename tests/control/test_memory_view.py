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


def test_each_rank_s_peak_is_predicted_within_10_percent_under_every_sharding() -> None:
    """mlp (a 16 MiB unit on stage 0, a 5 MiB last stage), 2 stages x 2 shards: after each change of sharding the
    allocator is measured again and the prediction made from the layers as measured then, every rank within 10% (it
    was 19% off when the table kept the profile measured under the first sharding); the two shards of a stage, which
    compute the same thing, measure the same (they read 8-17% apart while frees on gloo's own threads went unseen)."""
    with vpipe_lab.launch("mlp", stages=2, shards=2, microbatches=4, device="cpu", timeout=90) as session:
        for mode in ("hold", "regather", "scatter", "stream"):
            session.apply(session.plan.with_mesh(sharding=(mode, mode)))
            session.run(3)
            session.wait(timeout=180)
            rows = session.memory()
            changed = int(session.metrics.iterations["iteration"].max()) - 2
            assert (rows["allocated_at"] >= changed).all(), (mode, rows)  # measured after this change
            assert rows["error"].abs().max() < 0.10, (mode, rows)
            for _, stage in rows.groupby("stage"):
                first, second = stage["allocated_peak"]
                assert second == pytest.approx(first, rel=0.01), (mode, rows)
        session.apply(session.plan.with_mesh(sharding=("hold", "hold")))
        session.run(3)
        session.wait(timeout=180)
    # measured again since the table last asked, and the workers gone: the prediction from the layers in hand
    after = session.memory()
    assert after["predicted_peak"].notna().all() and (after["allocated_at"] > changed).all(), after
