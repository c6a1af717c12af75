"""The critical path of an iteration (core/cost/critical_path.py), on measured-style timelines (receives that last
as long as their stage waited) and simulated ones (sends only), and on the simulator's own schedules."""

from __future__ import annotations

from itertools import pairwise

from vpipe_lab.core.cost.critical_path import critical_path
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster
from vpipe_lab.core.timeline import Span, Timeline
from vpipe_lab.core.workloads import random_chain


def span(stage: int, kind: str, mb: int, start: float, end: float, it: int = 3) -> Span:
    return Span(stage, kind, mb, None, start, end, it)


def test_a_stage_that_waits_for_its_neighbour_puts_the_neighbour_on_the_path() -> None:
    # stage 0: forward mb0 0-2, send 2-2.1; stage 1: waits (recv 0-2.1), forward 2.1-3, backward 3-5, send 5-5.1;
    # stage 0: recv 2.1-5.1 (waited for the gradient), backward 5.1-8
    tl = Timeline((span(0, "forward", 0, 0, 2), span(0, "send", 0, 2, 2.1), span(1, "recv", 0, 0, 2.1),
                   span(1, "forward", 0, 2.1, 3), span(1, "backward", 0, 3, 5), span(1, "send", 0, 5, 5.1),
                   span(0, "recv", 0, 2.1, 5.1), span(0, "backward", 0, 5.1, 8), span(0, "idle", 0, 0, 8),
                   span(0, "forward", 0, 0, 1, it=2)))
    path = critical_path(tl)
    assert [(s.stage, s.kind) for s in path.spans] == [
        (0, "forward"), (0, "send"), (1, "recv"), (1, "forward"), (1, "backward"), (1, "send"), (0, "recv"),
        (0, "backward")]
    assert path.stages() == [0, 1, 0] and path.seconds == 8
    assert abs(path.share(stage=1, kinds=("forward", "backward")) - 2.9 / 8) < 1e-9
    assert critical_path(tl, iteration=2).spans == (span(0, "forward", 0, 0, 1, it=2),)
    assert critical_path(Timeline(())).spans == ()


def test_a_receive_that_did_not_wait_leaves_the_path_on_its_stage() -> None:
    tl = Timeline((span(1, "send", 0, 0, 0.1), span(0, "forward", 1, 0, 3), span(0, "recv", 0, 3, 3.01),
                   span(0, "backward", 0, 3.01, 4)))
    assert [s.kind for s in critical_path(tl).spans] == ["forward", "recv", "backward"]


def test_on_a_simulated_1f1b_iteration_the_path_spans_it_and_stays_on_the_stage_that_never_pauses() -> None:
    plan = Plan.from_counts([2, 2, 2], 4)
    tl = simulate(plan, random_chain(6, seed=1), Cluster(3, 10**12, 1e9, 1e9))
    path = critical_path(tl)
    assert abs(path.spans[0].start_s - tl.start_s) < 1e-9 and path.spans[-1].end_s == max(s.end_s for s in tl)
    # this profile's stage 1 (its sends share its compute stream) works without a pause from its first receive to
    # its last send, while stage 0 waits in receives and stage 2 idles: the path enters it once and stays
    assert path.stages() == [0, 1, 0] and path.share(stage=1) > 0.8
    ones = [s for s in tl if s.stage == 1 and s.kind != "idle" and s.kind != "recv"]
    assert all(a.end_s == b.start_s for a, b in pairwise(ones))
    for a, b in pairwise(path.spans):  # a chain in time: each released the next (a receive: its end)
        assert a.end_s <= (b.end_s if b.kind == "recv" else b.start_s) + 5e-4
