from vpipe_lab.telemetry.metrics import Metrics, spans_from_wire


def test_rolling_spans_and_frames() -> None:
    m = Metrics(span_window=2)
    for it in range(4):
        spans = spans_from_wire(0, it, [[0, 0, -1, it, it + 0.5], [3, 0, 2, it + 0.5, it + 0.6]])
        m.add({"iteration": it, "loss": 1.0 / (it + 1)}, spans, [{"iteration": it, "stage": 0, "peak": 10}])
    assert len(m.timeline()) == 4 and {s.iteration for s in m.timeline()} == {2, 3}
    assert list(m.iterations["iteration"]) == [0, 1, 2, 3]
    assert len(m.memory) == 4 and m.latest()["iteration"] == 3
    assert [r["iteration"] for r in m.records(last=2)] == [2, 3] and m.latest_memory()[0]["iteration"] == 3
    assert set(m.spans["kind"]) == {"forward", "swap_out"}
