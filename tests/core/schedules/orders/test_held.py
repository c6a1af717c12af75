"""What a stage holds along its order: the states of a chunked one (the chunk whose B comes next, dominated ones left
out), and what the transfers of one without chunks hold."""

from __future__ import annotations

from vpipe_lab.core import schedules
from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.plan import Plan, Policy
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile
from vpipe_lab.core.schedules.orders import interleaved
from vpipe_lab.core.schedules.orders.held import states, transfers


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


def test_transfers_count_the_tensors_sent_until_the_flush_and_the_receives_posted_ahead() -> None:
    """1F1B on 2 stages, M = 4, walked by hand: (input gradients sent, outputs sent whose B is done, an input posted
    ahead, a gradient posted ahead, a received gradient in use)."""
    rows = schedules.get("1f1b").orders(2, 1, 4)
    first = transfers([(op.value, c, mb) for op, c, mb in rows[0]], receives_input=False, receives_grad=True)
    # F0 F1 B0 F2 B1 F3 B2 B3: at B2 two outputs sent, B3's gradient posted ahead, B2's in use; at B3 three sent
    assert first == ((2, 2, 0, 1, 1), (3, 3, 0, 0, 1))
    last = transfers([(op.value, c, mb) for op, c, mb in rows[1]], receives_input=True, receives_grad=False)
    # F0 B0 F1 B1 F2 B2 F3 B3: at B2 two gradients sent and F3's input posted ahead; at B3 three sent, none ahead
    assert last == ((2, 2, 1, 0, 1), (3, 3, 0, 0, 1))


def test_the_cost_model_counts_what_the_transfers_hold_on_top_of_the_activations() -> None:
    """The same pipeline with 1 KiB crossing each way: stage 0 holds 4 of them at its most (two outputs sent, a
    gradient posted ahead, one in use), stage 1 three (gradients sent, or two and an input posted ahead); a chunked
    schedule's stages count none (not modelled)."""
    layer = LayerCost("l", 1e-3, 2e-3, 1 << 20, 1024, 1024, 1 << 16)
    profile = ModelProfile((layer,) * 4)
    cluster = Cluster(2, 1 << 34, 1e10, 1e12)
    cm = CostModel(profile, cluster, 4, "1f1b")
    assert [cm.comm_bytes(s, 2 * s, 2 * s + 2) for s in (0, 1)] == [4 * 1024, 3 * 1024]
    est = cm.estimate(Plan.from_counts([2, 2], 4))
    keep = [cm.stage_cost(s, 2 * s, 2 * s + 2, (Policy.KEEP,) * 4) for s in (0, 1)]
    assert est.peak_bytes == tuple(c.static_bytes + c.activation_bytes + c.rebuild_bytes + c.comm_bytes for c in keep)
    assert [c.comm_bytes for c in keep] == [4 * 1024, 3 * 1024]
    assert cm.keep_all_bytes(1, 2, 4) == est.peak_bytes[1]  # the memory planners count them too
    assert CostModel(profile, cluster, 4, "interleaved-1f1b", 2).comm_bytes(0, 0, 1) == 0


def test_a_long_pipeline_s_transfers_are_walked_in_linear_time() -> None:
    """Only the latest point per kind survives the walk (what was sent only grows), so 16,384 micro-batches on 4
    stages take one pass, not a comparison of every pair of points."""
    got = schedules.get("1f1b").transfers(4, 16384, 1)
    assert got == ((16380, 16380, 1, 1, 1), (16382, 16382, 0, 1, 1), (16383, 16383, 0, 0, 1))
