"""Where time goes: the split of a hand-made timeline, and of the simulator's replay of a plan."""

from __future__ import annotations

import pytest

from vpipe_lab.core.cost.breakdown import PARTS, bottleneck, breakdown, by_chunk
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.partition import uniform
from vpipe_lab.core.profile import LayerCost, ModelProfile
from vpipe_lab.core.timeline import Span, Timeline
from vpipe_lab.core.workloads import cluster, workload


def test_a_hand_made_iteration_splits_into_its_parts() -> None:
    # stage 0: forward 0-2, send 2-2.5, [waits], backward 6.2-9.2;  stage 1: recv 0-2.5 (waiting until stage 0's send
    # began at 2, then 0.5 on the wire), forward 2.5-4, recompute 4-5, backward 5-6, send 6-6.2, swap_out 3-3.5
    # beside its forward (a copy engine)
    spans = [Span(0, "forward", 0, None, 0, 2), Span(0, "send", 0, None, 2, 2.5),
             Span(0, "backward", 0, None, 6.2, 9.2),
             Span(1, "recv", 0, None, 0, 2.5), Span(1, "forward", 0, None, 2.5, 4), Span(1, "swap_out", 0, 1, 3, 3.5),
             Span(1, "recompute", 0, 1, 4, 5), Span(1, "backward", 0, None, 5, 6), Span(1, "send", 0, None, 6, 6.2),
             Span(1, "migrate", -1, None, 0, 9), Span(0, "idle", 0, None, 2.5, 6)]
    first, second = breakdown(Timeline(tuple(spans)))
    assert (first.iteration_s, first.compute_s, first.transfer_s) == (9.2, pytest.approx(5), 0.5)
    assert first.bubble_s == pytest.approx(3.7)
    assert (second.compute_s, second.recompute_s, second.swap_s) == (2.5, 1, 0.5)
    # the receive's 2 s of waiting for stage 0's forward are bubble, not the link's: only 0.5 s is wire
    assert second.transfer_s == pytest.approx(0.7) and second.bubble_s == pytest.approx(9.2 - 4.2)  # swap overlapped
    assert first.share("bubble") == pytest.approx(3.7 / 9.2)
    # the critical path: stage 0's forward and send, stage 1's work, stage 0's backward: stage 0 bounds it
    assert (first.critical_s, second.critical_s) == (pytest.approx(5.5), pytest.approx(3.7))
    assert bottleneck([first, second]) == 0 and first.dominant == "compute"
    with pytest.raises(ValueError, match="unknown part 'idle'"):
        first.share("idle")


def test_the_bottleneck_is_the_stage_that_bounds_most_iterations_not_one_stalled_op() -> None:
    """Three iterations of two stages in turn (forward on 0, then on 1): stage 1's work is 2 s, stage 0's 1 s, but in
    the last iteration stage 0 stalls for 20 s. By the mean, stage 0 holds the most of the path (22/3 s against 4/3);
    stage 1 bounded two iterations of three, and is named."""
    spans = []
    for it, first in enumerate((1.0, 1.0, 21.0)):
        t = 100.0 * it
        spans += [Span(0, "forward", 0, None, t, t + first, iteration=it),
                  Span(0, "send", 0, None, t + first, t + first, iteration=it),
                  Span(1, "recv", 0, None, t, t + first, iteration=it),
                  Span(1, "forward", 0, None, t + first, t + first + 2, iteration=it)]
    zero, one = breakdown(Timeline(tuple(spans)))
    assert zero.critical_s > one.critical_s and (zero.bounded, one.bounded) == (1, 2)
    assert bottleneck([zero, one]) == 1


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


def _chain(forward_ms: list[float], crossing_bytes: int) -> ModelProfile:
    """Layers of known forward times (backward twice that) whose outputs of ``crossing_bytes`` cross a cut."""
    return ModelProfile(tuple(LayerCost(f"l{i}", f / 1e3, 2 * f / 1e3, 1 << 20, 1 << 16, crossing_bytes, 1 << 20)
                              for i, f in enumerate(forward_ms)))


@pytest.mark.parametrize(("forward_ms", "heavy"), [([3, 3, 1, 1], 0), ([1, 1, 3, 3], 1)],
                         ids=["heavy first stage", "heavy last stage"])
def test_the_stage_that_computes_most_is_named_and_the_light_one_waits_not_transfers(forward_ms: list[float],
                                                                                     heavy: int) -> None:
    """Stage `heavy` computes three times the other, 16 KiB cross the cut: it bounds the iteration, and the light
    stage's waiting for it is bubble, not "transfer" (it was named the bottleneck with 68% "transfer")."""
    plan = Plan((0, 2, 4), ("keep",) * 4, 8, "1f1b")
    times = breakdown(simulate(plan, _chain(forward_ms, 16 << 10), cluster("rtx2080ti", 2)))
    light = times[1 - heavy]
    assert bottleneck(times) == heavy and times[heavy].dominant == "compute"
    assert light.share("transfer") < 0.05 and light.share("bubble") > 0.5
    assert times[heavy].critical_s > 2 * light.critical_s


def test_where_the_wire_really_dominates_transfer_is_named() -> None:
    """Tiny layers and 256 MiB crossing the cut per micro-batch: the link bounds the iteration."""
    plan = Plan((0, 2, 4), ("keep",) * 4, 4, "1f1b")
    times = breakdown(simulate(plan, _chain([0.1] * 4, 256 << 20), cluster("rtx2080ti", 2)))
    worst = times[bottleneck(times)]  # type: ignore[index]
    assert worst.dominant == "transfer" and worst.share("transfer") > 0.5
