"""The closed forms of 1F1B-shaped schedules and GPipe: GPipe's separate maxima, and latency on 1F1B's critical path
that eager 1F1B's extra micro-batch in flight hides."""

from __future__ import annotations

from vpipe_lab.core.schedules.pipeline_time import gpipe_time, one_f_one_b_time


def test_iteration_time_gpipe_uses_separate_maxima() -> None:
    assert one_f_one_b_time([1, 3], [3, 1], 3) == 8 + 2 * 4
    assert gpipe_time([1, 3], [3, 1], 3) == 8 + 2 * (3 + 3)


def test_a_round_trip_over_the_micro_batches_in_flight_bounds_the_step() -> None:
    assert one_f_one_b_time([1, 3], [3, 1], 3, latency_s=0.0, inflight=[2, 1]) == 8 + 2 * 4
    # two stages of 4 s, 1 s each way: a round trip of 10 s over stage 0's two micro-batches in flight
    assert one_f_one_b_time([2, 2], [2, 2], 3, latency_s=1.0, inflight=[2, 1]) == 8 + 2 + 2 * 5
    assert one_f_one_b_time([2, 2], [2, 2], 3, latency_s=1.0, inflight=[3, 1]) == 8 + 2 + 2 * 4
