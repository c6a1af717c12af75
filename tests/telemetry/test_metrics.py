import pytest

from tests.messages import report
from vpipe_lab.telemetry.metrics import Metrics, spans_from_wire


def test_rolling_spans_and_frames() -> None:
    m = Metrics(span_window=2)
    for it in range(4):
        spans = spans_from_wire(0, it, [[0, 0, -1, it, it + 0.5, 0], [3, 0, 2, it + 0.5, it + 0.6, 0]])
        m.add({"iteration": it, "loss": 1.0 / (it + 1)}, spans, [{"iteration": it, "stage": 0, "peak": 10}])
    assert len(m.timeline()) == 4 and {s.iteration for s in m.timeline()} == {2, 3}
    assert list(m.iterations["iteration"]) == [0, 1, 2, 3]
    assert len(m.memory) == 4 and m.latest()["iteration"] == 3
    assert [r["iteration"] for r in m.records(last=2)] == [2, 3] and m.latest_memory()[0]["iteration"] == 3
    assert set(m.spans["kind"]) == {"forward", "swap_out"}
    # the newest iteration's critical path: its forward (the swap runs beside compute, off the path)
    path = m.critical_path()
    assert [(s.iteration, s.kind) for s in path.spans] == [(3, "forward")] and path.seconds == 0.5
    assert m.critical_path(2).spans[0].iteration == 2


def test_every_replica_s_spans_and_memory_are_kept_and_the_first_replica_s_ranks_reported() -> None:
    from vpipe_lab.telemetry.metrics import IterationParts

    parts = IterationParts(stages=2, replicas=2)
    done = None
    for replica in (1, 0):  # any arrival order
        for stage in (1, 0):
            done = parts.add(report(5, stage, replica=replica, losses=[1.0 + replica] if stage == 1 else [], samples=4,
                                    spans=[[0, 0, -1, 0.1 * replica, 0.5, 0]], memory={"peak": 100 * (replica + 1)}))
    assert done is not None
    assert sorted((s.replica, s.stage) for s in done.spans) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(r["replica"], r["stage"], r["peak"]) for r in done.memory] == [(0, 0, 100), (0, 1, 100), (1, 0, 200),
                                                                            (1, 1, 200)]
    assert [(b.replica, b.stage) for b in done.ranks] == [(0, 0), (0, 1)]
    assert done.record["loss"] == 1.5 and [r["loss"] for r in done.replicas] == [1.0, 2.0]


def test_sink_scalars_keep_one_row_per_stage() -> None:
    from vpipe_lab.telemetry.sinks import scalars

    memory = [{"stage": 0, "replica": 0, "peak": 10}, {"stage": 0, "replica": 1, "peak": 99}]
    assert scalars({"loss": 1.0}, memory) == {"loss": 1.0, "stage0/peak_bytes": 10.0}


def test_the_gap_between_iterations_is_the_median_over_consecutive_ones() -> None:
    """Gaps of 2, 3 and 4 ms between iterations 0..3, a 10 s pause before 5 (4 missing: not consecutive with 3),
    then 3 ms: the median, 3 ms, ignores the pause; fewer than two iterations give 0."""
    m = Metrics()
    assert m.iteration_gap_s() == 0.0
    starts = {0: 0.0, 1: 0.102, 2: 0.205, 3: 0.309, 5: 10.409, 6: 10.512}
    for it, start in starts.items():
        m.add({"iteration": it, "start_s": start, "end_s": start + 0.1}, [], [])
    assert m.iteration_gap_s() == pytest.approx(0.003)
    assert m.iteration_gap_s(last=1) == pytest.approx(0.003)  # only 5 -> 6


def test_the_micro_batch_size_is_read_from_the_newest_iteration() -> None:
    m = Metrics()
    assert m.microbatch_size() == 0  # nothing ran yet
    m.add({"iteration": 0, "samples": 64, "microbatches": 4}, [], [])
    assert m.microbatch_size() == 16 and m.microbatch_size(replicas=2) == 8


def test_per_stage_memory_keeps_a_window_in_memory_and_every_row_on_request() -> None:
    m = Metrics(window=10)
    for it in range(50):
        m.add({"iteration": it, "loss": 1.0, "start_s": float(it), "end_s": it + 0.5}, [],
              [{"iteration": it, "stage": s, "peak": it * 10 + s} for s in range(2)])
    assert m._memory.in_memory == 10 and len(m.memory) == 100 and list(m.memory["peak"])[:3] == [0, 1, 10]
    assert len(m.iterations) == 50 and m.latest_memory()[1]["peak"] == 491
    assert m.iteration_gap_s() == pytest.approx(0.5)  # from the newest iterations only


def test_the_breakdown_splits_each_stage_s_recent_iterations() -> None:
    m = Metrics()
    for it in range(3):
        spans = spans_from_wire(0, it, [[0, 0, -1, it, it + 0.4, 0], [1, 0, -1, it + 0.6, it + 1.0, 0]])
        spans += spans_from_wire(1, it, [[6, 0, -1, it, it + 0.4, 0], [0, 0, -1, it + 0.4, it + 0.6, 0]])
        m.add({"iteration": it}, spans, [])
    frame = m.breakdown(last=2)
    assert list(frame["stage"]) == [0, 1] and list(frame["bottleneck"]) == [True, False]
    assert frame.loc[0, "compute_share"] == pytest.approx(0.8) and frame.loc[1, "transfer_s"] == pytest.approx(0.4)
    assert frame.loc[1, "bubble_share"] == pytest.approx(0.4)
    assert Metrics().breakdown().empty and "compute_share" in Metrics().breakdown().columns


def test_experts_load_is_summed_over_replicas_kept_per_iteration_and_given_a_row_per_expert() -> None:
    from vpipe_lab.telemetry.metrics import IterationParts

    m = Metrics()
    parts = IterationParts(stages=2, replicas=2)
    for it in range(3):
        done = None
        for replica in (0, 1):
            done = parts.add(report(it, 0, replica=replica, experts={"a.mlp": {"tokens": [3, 1], "dropped": None}}))
            done = parts.add(report(it, 1, replica=replica,
                                    experts={"b.mlp": {"tokens": [it, 4 - it], "dropped": [1, 0]}})) or done
        assert done is not None
        assert [(r["layer"], r["stage"], r["tokens"], r["dropped"]) for r in done.experts] == [
            ("a.mlp", 0, [6, 2], None), ("b.mlp", 1, [2 * it, 8 - 2 * it], [2, 0])]
        m.add(done.record, done.spans, done.memory, done.experts)
    assert [r["iteration"] for r in m.expert_records(iterations=2)] == [1, 1, 2, 2]
    frame = m.experts
    assert list(frame.columns) == ["iteration", "stage", "layer", "expert", "tokens", "share", "dropped"]
    assert len(frame) == 3 * 2 * 2
    row = frame[(frame.iteration == 2) & (frame.layer == "b.mlp")]
    assert row["tokens"].tolist() == [4, 4] and row["share"].tolist() == [0.5, 0.5] and row["dropped"].tolist() == [2, 0]
    assert frame[frame.layer == "a.mlp"]["dropped"].isna().all()  # no capacity: nothing to drop


def test_a_dense_model_has_an_empty_experts_frame() -> None:
    m = Metrics()
    m.add({"iteration": 0}, [], [])
    assert m.experts.empty and list(m.experts.columns)[:3] == ["iteration", "stage", "layer"]
    assert m.expert_records(iterations=5) == []
