"""Where time goes: the split of a hand-made timeline, and of the simulator's replay of a plan."""

from __future__ import annotations

import pytest

from vpipe_lab.core.cost.breakdown import PARTS, bottleneck, breakdown, by_chunk
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.partition import uniform
from vpipe_lab.core.timeline import Span, Timeline
from vpipe_lab.core.workloads import cluster, workload


def test_a_hand_made_iteration_splits_into_its_parts() -> None:
    # stage 0: forward 0-2, send 2-2.5, [waits], backward 6-9;  stage 1: recv 0-2.5 (waiting), forward 2.5-4,
    # recompute 4-5, backward 5-6, send 6-6.2, swap_out 3-3.5 beside its forward (a copy engine)
    spans = [Span(0, "forward", 0, None, 0, 2), Span(0, "send", 0, None, 2, 2.5), Span(0, "backward", 0, None, 6, 9),
             Span(1, "recv", 0, None, 0, 2.5), Span(1, "forward", 0, None, 2.5, 4), Span(1, "swap_out", 0, 1, 3, 3.5),
             Span(1, "recompute", 0, 1, 4, 5), Span(1, "backward", 0, None, 5, 6), Span(1, "send", 0, None, 6, 6.2),
             Span(1, "migrate", -1, None, 0, 9), Span(0, "idle", 0, None, 2.5, 6)]
    first, second = breakdown(Timeline(tuple(spans)))
    assert (first.iteration_s, first.compute_s, first.transfer_s, first.bubble_s) == (9, 5, 0.5, 3.5)
    assert (second.compute_s, second.recompute_s, second.swap_s) == (2.5, 1, 0.5)
    assert second.transfer_s == pytest.approx(2.7) and second.bubble_s == pytest.approx(9 - 6.2)  # swap overlapped
    assert first.share("bubble") == pytest.approx(3.5 / 9) and bottleneck([first, second]) == 1
    with pytest.raises(ValueError, match="unknown part 'idle'"):
        first.share("idle")


def test_iterations_average_and_replicas_stay_apart() -> None:
    spans = [Span(0, "forward", 0, None, 10 * it, 10 * it + 2 + it, iteration=it) for it in range(2)]
    spans.append(Span(0, "forward", 0, None, 0, 100, iteration=0, replica=1))
    (one,) = breakdown(Timeline(tuple(spans)))
    assert (one.iterations, one.compute_s, one.bubble_s) == (2, 2.5, 0.0)
    assert breakdown(Timeline(())) == [] and bottleneck([]) is None


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)])
def test_the_simulated_split_accounts_for_the_whole_iteration(schedule: str, virtual: int) -> None:
    profile, hw = workload("bert-48"), cluster("rtx2080ti", 4)
    plan = Plan(uniform(len(profile), 4 * virtual), ("keep",) * len(profile), 8, schedule, virtual)
    times = breakdown(simulate(plan, profile, hw))
    assert len(times) == 4 and all(t.iterations == 1 for t in times)
    for t in times:  # every part is time in the window, and without swaps they add up to it
        assert sum(t.seconds(p) for p in PARTS) == pytest.approx(t.iteration_s, rel=1e-9)
        assert t.bubble_s >= 0
    assert bottleneck(times) in range(4)


def test_each_chunk_s_share_of_its_stage() -> None:
    profile, hw = workload("bert-48"), cluster("rtx2080ti", 4)
    plan = Plan(uniform(len(profile), 8), ("keep",) * len(profile), 8, "interleaved-1f1b", 2)
    sim = simulate(plan, profile, hw)
    chunks = by_chunk(sim)
    assert [(c.stage, c.chunk) for c in chunks if c.stage == 1] == [(1, 0), (1, 1)]  # its first and second chunk
    for t in breakdown(sim):  # a stage's chunks share its compute: their compute adds up to the stage's
        assert sum(c.compute_s for c in chunks if c.stage == t.stage) == pytest.approx(t.compute_s)
    with pytest.raises(ValueError, match="a chunk's parts are compute, recompute, swap, transfer, not 'bubble'"):
        chunks[0].seconds("bubble")
