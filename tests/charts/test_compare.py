"""Figures of the session's record (charts/compare.py): valid plotly JSON, two iterations on one scale, the splits
side by side, measured beside predicted."""

from __future__ import annotations

import json

import pytest

from vpipe_lab.charts.compare import pair_spec, record_spec, split_spec
from vpipe_lab.core.cost.breakdown import StageTime
from vpipe_lab.core.timeline import Span, Timeline


def iteration(start: float, stage1_s: float) -> Timeline:
    return Timeline((Span(0, "forward", 0, None, start, start + 0.2, 4), Span(1, "forward", 0, None, start + 0.2,
                                                                              start + 0.2 + stage1_s, 4)))


def test_two_iterations_share_the_time_axis_in_lanes_of_their_own() -> None:
    spec = pair_spec(iteration(100.0, 0.3), iteration(500.0, 0.6), ("entry 0", "entry 2"))
    json.dumps(spec, allow_nan=False)
    forward = [t for t in spec["data"] if t["name"] == "forward"]
    assert len(forward) == 2 and [t["showlegend"] for t in forward] == [True, False]  # one legend entry per kind
    xs = [[x for x in t["x"] if x is not None] for t in forward]
    assert max(xs[0]) == pytest.approx(500.0) and max(xs[1]) == pytest.approx(800.0)  # from their own start, in ms
    ys = [{y for y in t["y"] if y is not None} for t in forward]
    assert ys == [{0.0, 1.0}, {3.0, 4.0}]  # entry 2's lanes below entry 0's, an empty lane between
    assert spec["layout"]["yaxis"]["ticktext"] == ["entry 0 · stage 0", "entry 0 · stage 1", "entry 2 · stage 0",
                                                   "entry 2 · stage 1"]
    alone = pair_spec(None, iteration(0.0, 0.1), ("entry 0", "entry 1"))  # nothing kept of entry 0
    assert {t["name"] for t in alone["data"]} >= {"forward"}


def test_splits_stand_stage_by_stage_and_the_record_beside_its_predictions() -> None:
    a = [StageTime(0, 1.0, 0.5, 0.0, 0.0, 0.1, 0.4), StageTime(1, 1.0, 0.9, 0.0, 0.0, 0.1, 0.0)]
    b = [StageTime(0, 0.8, 0.6, 0.0, 0.0, 0.1, 0.1), StageTime(1, 0.8, 0.6, 0.1, 0.0, 0.0, 0.1)]
    spec = split_spec(a, b, ("entry 0", "entry 1"))
    json.dumps(spec, allow_nan=False)
    compute = next(t for t in spec["data"] if t["name"] == "compute")
    assert compute["x"] == ["stage 0 · entry 0", "stage 0 · entry 1", "stage 1 · entry 0", "stage 1 · entry 1"]
    assert compute["y"] == [500.0, 600.0, 900.0, 600.0]
    rows = [{"entry": 0, "source": "launch", "plan": "p0", "median_s": 0.12, "predicted_s": None},
            {"entry": 1, "source": "editor", "plan": "p1", "median_s": 0.1, "predicted_s": 0.095}]
    record = record_spec(rows)
    json.dumps(record, allow_nan=False)
    assert record["data"][0]["x"] == ["0 launch", "1 editor"] and record["data"][0]["y"] == [120.0, 100.0]
    assert record["data"][1]["y"] == [None, 95.0]


def test_peaks_stand_against_the_budget_and_a_budget_far_above_them_leaves_the_scale() -> None:
    from vpipe_lab.charts.compare import peak_spec

    gib = 2**30
    near = peak_spec([1 * gib, 2 * gib], [3 * gib, 1 * gib], [4 * gib, 4 * gib])
    running, draft, budget = near["data"]
    assert running["y"] == [1.0, 2.0] and draft["y"] == [3.0, 1.0] and draft["visible"] and budget["y"] == [4.0, 4.0]
    assert "range" not in near["layout"]["yaxis"] and near["layout"]["title"]["text"] == "predicted peak memory per stage"
    far = peak_spec([10 * 2**20, 20 * 2**20], None, [12 * gib, 12 * gib])  # MiB peaks against a whole host's memory
    assert far["layout"]["yaxis"]["range"] == pytest.approx([0.0, 1.25 * 20 / 1024])
    assert far["layout"]["title"]["text"].endswith("<br><sub>budget 12 GiB a stage, off the scale: the largest peak is "
                                                   "0.2% of it</sub>")
    assert not far["data"][1]["visible"]
    assert "range" not in peak_spec([gib], None, [None])["layout"]["yaxis"]  # no budget: nothing to leave off
