import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.cost.simulator import compute_bound_s, period_s, run_schedule, simulate
from vpipe_lab.core.errors import ScheduleError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile
from vpipe_lab.core.schedules.actions import Schedule
from vpipe_lab.core.schedules.builders import for_plan, gpipe, one_f_one_b, zb_h1
from vpipe_lab.core.timeline import Span, Timeline

FREE = dict(swap_bandwidth=1e12, link_bandwidth=1e30)


def equal(k: int, per_stage: int = 1, fwd: float = 1.0, bwd: float = 1.0) -> ModelProfile:
    return ModelProfile(tuple(LayerCost(f"l{i}", fwd, bwd, 10, 1, 1, 1) for i in range(k * per_stage)))


def test_gpipe_staircase() -> None:
    t = simulate(Plan.from_counts([1, 1, 1], 4, "gpipe"), equal(3), Cluster(3, 10**9, **FREE))
    assert t.format_ascii(1.0) == "\n".join([
        "0: F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3",
        "1: .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 ..",
        "2: .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. ..",
    ])


def test_1f1b_staircase() -> None:
    t = simulate(Plan.from_counts([1, 1, 1], 4, "1f1b"), equal(3), Cluster(3, 10**9, **FREE))
    assert t.format_ascii(1.0) == "\n".join([
        "0: F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3",
        "1: .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..",
        "2: .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..",
    ])


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 6), m=st.integers(1, 9), per=st.integers(1, 3), fwd=st.floats(0.1, 3), bwd=st.floats(0.1, 3),
       schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_equal_stages_take_m_plus_k_minus_1_stage_times(k: int, m: int, per: int, fwd: float, bwd: float,
                                                        schedule: str) -> None:
    profile = equal(k, per, fwd, bwd)
    plan = Plan.from_counts([per] * k, m, schedule)
    t = simulate(plan, profile, Cluster(k, 10**9, **FREE))
    expected = (m + k - 1) * per * (fwd + bwd)
    assert math.isclose(t.iteration_s, expected, rel_tol=1e-9)
    assert math.isclose(estimate(plan, profile, Cluster(k, 10**9, **FREE)).iteration_s, expected, rel_tol=1e-9)


def test_communication_adds_send_spans_and_time() -> None:
    profile = ModelProfile(tuple(LayerCost(f"l{i}", 1.0, 1.0, 10, 100, 100, 1) for i in range(2)))
    plan = Plan.from_counts([1, 1], 2, "1f1b")
    t = simulate(plan, profile, Cluster(2, 10**9, 1e12, link_bandwidth=100.0))
    sends = t.select(kind="send")
    assert len(sends) == 4 and all(math.isclose(s.duration_s, 1.0) for s in sends)
    assert t.iteration_s > simulate(plan, profile, Cluster(2, 10**9, **FREE)).iteration_s


def test_swap_in_that_cannot_hide_delays_the_backward() -> None:
    profile = ModelProfile((LayerCost("a", 1.0, 1.0, activation_bytes=1000, input_bytes=1, output_bytes=1,
                                      param_bytes=1),))
    keep = simulate(Plan((0, 1), "k", 2, "gpipe"), profile, Cluster(1, 10**9, 1e12, 1e12))
    slow = simulate(Plan((0, 1), "s", 2, "gpipe"), profile, Cluster(1, 10**9, 100.0, 1e12))
    fast = simulate(Plan((0, 1), "s", 2, "gpipe"), profile, Cluster(1, 10**9, 1e9, 1e12))
    assert math.isclose(fast.iteration_s, keep.iteration_s, rel_tol=1e-6)
    assert slow.iteration_s > keep.iteration_s + 10
    assert len(slow.select(kind={"swap_out", "swap_in"})) == 4


def test_swaps_on_the_compute_thread_add_their_copies_to_the_stage() -> None:
    """CPU ranks copy on their compute thread (``Cluster.swap_overlaps=False``): a swap the copy engine would hide
    costs its copy out and back in, in the replay and in the cost model alike (one stage: no bubble to hide in)."""
    profile = ModelProfile((LayerCost("a", 1.0, 1.0, activation_bytes=1000, input_bytes=1, output_bytes=1,
                                      param_bytes=1),))
    plan = Plan((0, 1), "s", 2, "gpipe")
    hidden = Cluster(1, 10**9, 1e3, 1e12)  # 1 s per copy: hidden by the cost model under 2 s of compute
    on_compute = Cluster(1, 10**9, 1e3, 1e12, swap_overlaps=False)
    keep = simulate(Plan((0, 1), "k", 2, "gpipe"), profile, hidden).iteration_s
    exposed = simulate(plan, profile, on_compute)
    assert math.isclose(exposed.iteration_s, keep + 2 * 2 * 1.0, rel_tol=1e-6)  # 2 micro-batches, out and in
    assert math.isclose(estimate(plan, profile, on_compute).iteration_s, exposed.iteration_s, rel_tol=1e-6)
    assert math.isclose(estimate(plan, profile, hidden).iteration_s, keep, rel_tol=1e-6)


def test_recompute_spans_come_before_backward() -> None:
    profile = equal(1, 2)
    t = simulate(Plan((0, 2), "rk", 1, "1f1b"), profile, Cluster(1, 10**9, **FREE))
    rec = t.select(kind="recompute").spans[0]
    back = t.select(kind="backward").spans[0]
    assert rec.layer == 0 and rec.end_s <= back.start_s and math.isclose(t.iteration_s, 5.0)


def test_deadlock_is_reported() -> None:
    rows = ["0F0 0SF0 0RB0 0B0 0F1 0SF1 0RB1 0B1", "1RF0 1F0 1RF1 1F1 1B0 1SB0 1B1 1SB1"]
    with pytest.raises(ScheduleError, match="deadlocks"):
        run_schedule(Schedule.parse(rows, 1), lambda a: 1.0)


def test_generated_schedules_never_deadlock() -> None:
    for k in range(1, 6):
        for m in range(1, 7):
            for make in (gpipe, one_f_one_b, zb_h1):
                run_schedule(make(k, m), lambda a: 1.0)


def test_compute_bound_replays_measured_compute_with_free_transfers() -> None:
    plan = Plan.from_counts([1, 1], 2, "1f1b")
    cluster = Cluster(2, 10**9, swap_bandwidth=1e12, link_bandwidth=1e3)  # slow link: sends take time
    measured = simulate(plan, equal(2), cluster)
    assert measured.select(kind="send").spans and measured.iteration_s > 6.0
    # Two stages of F = B = 1 and M = 2 need 6 units without transfer time, whatever the measured sends took.
    assert compute_bound_s(one_f_one_b(2, 2), measured) == pytest.approx(6.0)
    # An unequal stage moves the bound: stage 1's backward of micro-batch 0 took 3 units instead of 1.
    slow = Timeline(tuple(Span(s.stage, s.kind, s.microbatch, s.layer, s.start_s,
                               s.end_s + (2.0 if (s.stage, s.kind, s.microbatch) == (1, "backward", 0) else 0.0))
                          for s in measured))
    assert compute_bound_s(one_f_one_b(2, 2), slow) == pytest.approx(8.0)
    # Actions without spans take no time.
    assert compute_bound_s(one_f_one_b(2, 2), Timeline()) == 0.0


def test_zb_h1_replays_b_and_w_apart_with_the_weight_share() -> None:
    """The simulator times B as the backward less its weight share and W as that share; on equal stages ZB-H1 beats
    1F1B by the weight steps it moves out of the fill and drain, and the cost model's closed form agrees."""
    k, m = 4, 8
    profile = equal(k, fwd=1.0, bwd=2.0)  # W = 1 (half the backward of a layer with parameters)
    cluster = Cluster(k, 10**9, **FREE)
    plan = Plan.from_counts([1] * k, m, "zb-h1")
    t = simulate(plan, profile, cluster)
    assert {s.kind for s in t} >= {"forward", "backward", "wgrad"}
    assert all(s.duration_s == 1.0 for s in t if s.kind in ("backward", "wgrad"))
    assert t.iteration_s == 3 * m + (k - 1) == estimate(plan, profile, cluster).iteration_s
    assert simulate(plan.replace(schedule="1f1b"), profile, cluster).iteration_s == 3 * (m + k - 1)


@pytest.mark.parametrize(("schedule", "virtual"), [("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_compute_bound_of_a_free_link_replay_is_the_replay(schedule: str, virtual: int) -> None:
    """A rank's spans name their chunk: under interleaved 1F1B each chunk's actions take their own spans' time (not
    the sum over the rank's chunks), and ZB-H1's weight steps count as compute."""
    profile = ModelProfile(tuple(LayerCost(f"l{i}", 1.0 + i / 8, 2.0, 100, 10, 10, 10, weight_grad_s=0.5) for i in range(8)))
    cluster = Cluster(2, 10**9, 1e30, 1e30)
    plan = Plan(tuple(range(0, 9, 8 // (2 * virtual))), ("keep",) * 8, 4, schedule, virtual)
    replay = simulate(plan, profile, cluster)
    assert {s.chunk for s in replay} == set(range(virtual))
    assert compute_bound_s(for_plan(plan), replay) == pytest.approx(replay.iteration_s)


def test_the_period_adds_the_measured_time_between_iterations() -> None:
    profile = ModelProfile(tuple(LayerCost(f"l{i}", 1e-3, 2e-3, 1 << 20, 1 << 16, 1 << 16, 1 << 20) for i in range(4)))
    plan = Plan.from_counts([2, 2], 4)
    cluster = Cluster(2, 1 << 34, 1e10, 1e12, iteration_overhead_s=0.004)
    assert Cluster.from_json(cluster.to_json()) == cluster
    assert period_s(plan, profile, cluster) == pytest.approx(simulate(plan, profile, cluster).iteration_s + 0.004)
