import json

import pytest

from vpipe_lab.core.errors import ProfileError
from vpipe_lab.core.timeline import Span, Timeline


def sample() -> Timeline:
    return Timeline((
        Span(0, "forward", 0, None, 0.0, 1.0),
        Span(0, "swap_out", 0, 3, 1.0, 1.5),
        Span(1, "recv", 0, None, 0.0, 1.2),
        Span(1, "forward", 0, None, 1.2, 2.0),
        Span(0, "backward", 0, None, 3.0, 4.0),
    ))


def test_basic_queries() -> None:
    t = sample()
    assert t.stages == 2 and t.iteration_s == 4.0
    assert t.busy_s(0) == 2.0
    assert len(t.select(stage=0)) == 3 and len(t.select(kind={"forward", "backward"})) == 3
    assert t.shift(1.0).start_s == 1.0


def test_scaled_stretches_every_span_from_the_first_start() -> None:
    t = sample().shift(10.0)
    doubled = t.scaled(2.0)
    assert doubled.start_s == 10.0 and doubled.iteration_s == pytest.approx(8.0)
    assert [(s.kind, s.start_s, s.end_s) for s in doubled.select(stage=1)] == [
        ("recv", 10.0, pytest.approx(12.4)), ("forward", pytest.approx(12.4), pytest.approx(14.0))]
    assert doubled.busy_s(0) == pytest.approx(2 * t.busy_s(0)) and t.scaled(1.0) == t
    with pytest.raises(ValueError, match="scaled by 0"):
        t.scaled(0)


def test_idle_fills_compute_gaps_only() -> None:
    idle = sample().with_idle().select(kind="idle")
    assert [(s.stage, s.start_s, s.end_s) for s in idle] == [(0, 1.0, 3.0)]


def test_json_and_pandas_round_trip() -> None:
    t = sample()
    assert Timeline.from_json(t.to_json()) == t
    frame = t.to_pandas()
    assert list(frame.columns)[:7] == ["stage", "kind", "microbatch", "layer", "start_s", "end_s", "iteration"]
    assert frame["duration_s"].sum() == pytest.approx(sum(s.duration_s for s in t))


def test_chrome_trace_is_valid_trace_event_json() -> None:
    trace = sample().to_chrome_trace()
    text = json.dumps(trace)
    doc = json.loads(text)
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 5
    swap = next(e for e in events if e["cat"] == "swap_out")
    assert swap["tid"] == 1 and swap["ts"] == pytest.approx(1e6) and swap["dur"] == pytest.approx(0.5e6)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"stage 0", "stage 1"}


def test_a_stages_chunks_travel_through_json_pandas_and_the_trace() -> None:
    t = Timeline((Span(0, "forward", 0, None, 0.0, 1.0), Span(0, "forward", 0, None, 1.0, 2.0, chunk=1)))
    assert t.chunks == 2 and Timeline.from_json(t.to_json()) == t and list(t.to_pandas()["chunk"]) == [0, 1]
    events = [e for e in t.to_chrome_trace()["traceEvents"] if e["ph"] == "X"]
    assert [e["args"]["chunk"] for e in events] == [0, 1] and events[1]["name"] == "forward mb0 chunk 1"
    assert Timeline().chunks == 1


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(ProfileError, match="span kind 'compute'"):
        Timeline((Span(0, "compute", 0, None, 0, 1),))


def test_replicas_get_their_own_lanes_idle_and_trace_processes() -> None:
    spans = (Span(0, "forward", 0, None, 0.0, 1.0), Span(0, "forward", 1, None, 2.0, 3.0),
             Span(0, "forward", 0, None, 0.0, 0.5, replica=1), Span(0, "forward", 1, None, 1.5, 2.0, replica=1))
    t = Timeline(spans)
    assert t.replicas == 2 and t.stages == 1 and len(t.select(replica=1)) == 2
    idle = t.with_idle().select(kind="idle")
    assert sorted((s.replica, s.start_s, s.end_s) for s in idle) == [(0, 1.0, 2.0), (1, 0.5, 1.5)]
    assert t.busy_s(0) == 2.0 and t.busy_s(0, replica=1) == 1.0
    names = [e["args"]["name"] for e in t.to_chrome_trace()["traceEvents"] if e["name"] == "process_name"]
    assert names == ["replica 0 stage 0", "replica 1 stage 0"]
    assert {e["pid"] for e in t.to_chrome_trace()["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert Timeline.from_json(t.to_json()) == t and list(t.to_pandas()["replica"]) == [0, 0, 1, 1]


def test_step_overhead_is_the_uncovered_time_per_compute_step() -> None:
    spans = Timeline((
        # iteration 0, stage 0: 0.1 uncovered before the send, 0.2 before the backward; the swap runs beside
        Span(0, "forward", 0, None, 0.0, 1.0), Span(0, "send", 0, None, 1.1, 1.2),
        Span(0, "swap_in", 0, 3, 1.0, 1.9), Span(0, "backward", 0, None, 1.4, 2.0),
        # stage 1: back to back
        Span(1, "forward", 0, None, 0.0, 1.0), Span(1, "wgrad", 0, None, 1.0, 2.0),
        # iteration 1, stage 1: 0.6 uncovered
        Span(1, "forward", 0, None, 5.0, 6.0, iteration=1), Span(1, "backward", 0, None, 6.6, 7.0, iteration=1),
    ))
    assert spans.step_overhead_s() == pytest.approx(0.15)  # the median of 0.3 / 2, 0 / 2 and 0.6 / 2
    assert Timeline().step_overhead_s() == 0.0
    # a backward in two pieces around a layer's rebuild is still one step: 0.2 uncovered over 2 steps
    rebuilt = Timeline((Span(0, "forward", 0, None, 0.0, 1.0), Span(0, "backward", 0, None, 1.2, 1.5),
                        Span(0, "recompute", 0, 4, 1.5, 1.8), Span(0, "backward", 0, None, 1.8, 2.0)))
    assert rebuilt.step_overhead_s() == pytest.approx(0.1)
