"""What a stage holds along a chunked order: the states, with the chunk whose B comes next, dominated ones left out."""

from __future__ import annotations

from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile
from vpipe_lab.core.schedules.orders import interleaved
from vpipe_lab.core.schedules.orders.held import states


def test_states_count_forwards_awaiting_b_and_backwards_awaiting_w_per_chunk() -> None:
    order = [("F", 0, 0), ("F", 0, 1), ("F", 3, 0), ("B", 3, 0), ("W", 3, 0), ("B", 0, 0), ("B", 0, 1), ("W", 0, 0),
             ("W", 0, 1)]
    got = states(order, (0, 3))
    assert (2, 1, 0, 0, -1) in got and (2, 1, 0, 0, 1) in got  # the peak, and the same right before chunk 3's B
    assert (2, 0, 0, 0, 0) in got  # before chunk 0's first B
    assert (1, 0, 0, 0, -1) not in got  # dominated by (2, 1, 0, 0, -1)
    assert all(len(s) == 5 for s in got)


def test_an_interleaved_stage_peaks_by_its_chunks_bytes_not_its_count_times_the_largest() -> None:
    """Rank 0 of 2, V = 2, M = 4 holds 3 and 2 (or 4 and 1) chunk-forwards at its peak, 5 in all: with a large first
    chunk and a small second, the peak is 4 large + 1 small, not 5 large."""
    big, small = (LayerCost("b", 1e-3, 2e-3, 1000, 10, 10, 0), LayerCost("s", 1e-3, 2e-3, 100, 10, 10, 0))
    profile = ModelProfile((big, small, small, small))  # chunk 0 (rank 0) big; chunk 2 (rank 0) small
    cm = CostModel(profile, Cluster(2, 10**9, 1e12, 1e12), 4, "interleaved-1f1b", 2)
    est = cm.estimate(Plan((0, 1, 2, 3, 4), "kkkk", 4, "interleaved-1f1b", 2))
    assert max(sum(h[:2]) for h in interleaved.held(2, 2, 4, 0)) == interleaved.peak_inflight(2, 2, 4, 0) == 5
    assert est.activation_bytes[0] == 4 * 1000 + 1 * 100 < 5 * 1000
