from pathlib import Path

from vpipe_lab.charts.figures import gantt_data, gantt_figure, lane, memory_figure, memory_values, save_html
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster
from vpipe_lab.core.timeline import KINDS, Span, Timeline
from vpipe_lab.core.workloads import random_chain


def timeline():  # type: ignore[no-untyped-def]
    profile = random_chain(6, seed=1)
    plan = Plan((0, 3, 6), ("swap", "keep", "keep", "recompute", "keep", "keep"), 3, "1f1b")
    return simulate(plan, profile, Cluster(2, 10**12, 1e9, 1e9))


def test_gantt_has_one_trace_per_kind_with_nan_gaps() -> None:
    t = timeline()
    fig = gantt_figure(t)
    assert [tr.name for tr in fig.data] == list(KINDS)
    fwd = next(tr for tr in fig.data if tr.name == "forward")
    assert len(fwd.x) == 3 * len(t.select(kind="forward")) and fwd.x[2] is None
    swaps = gantt_data(t)["swap_out"]
    assert swaps["y"][0] == lane(0, "swap_out") and lane(0, "swap_out") != lane(0, "forward")


def test_a_stage_with_virtual_stages_gets_a_compute_lane_per_chunk() -> None:
    """Interleaved 1F1B, two chunks per stage: each chunk's spans on a lane of its own inside its stage's, named
    "stage s · cN", the stage's idle time on each of them, its copy lane apart from all."""
    from vpipe_lab.charts.figures import gantt_spec

    profile = random_chain(8, seed=1)
    t = simulate(Plan((0, 2, 4, 6, 8), ("keep",) * 8, 4, "interleaved-1f1b", 2), profile, Cluster(2, 10**12, 1e9, 1e7))
    t = t + Timeline((Span(1, "idle", 0, None, t.end_s, t.end_s + 1e-3),))  # the stage's, not a chunk's
    assert t.chunks == 2 and {(s.stage, s.chunk) for s in t.select(kind="forward")} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    spec = gantt_spec(t, stages=2)
    ticks = spec["layout"]["yaxis"]
    assert ticks["ticktext"] == ["stage 0 · c0", "stage 0 · c1", "stage 1 · c0", "stage 1 · c1"]
    forward = next(tr for tr in spec["data"] if tr["name"] == "forward")
    assert sorted({y for y in forward["y"] if y is not None}) == ticks["tickvals"]
    assert any("chunk 1" in text for text in forward["text"])
    idle = t.select(kind="idle")
    assert idle.spans and len([y for y in gantt_data(t)["idle"]["y"] if y is not None]) == 2 * 2 * len(idle)
    assert lane(0, "swap_in", chunk=1, chunks=2) == lane(0, "swap_in") not in ticks["tickvals"]


def test_memory_values_and_html(tmp_path: Path) -> None:
    fig = memory_figure(2, [2**30, 2**30])
    vals = memory_values([2**30, 0], [2**29, 0], [2**31, 0], [0, 0])
    assert vals[0][0] == 1.0 and vals[1][0] == 0.5 and vals[2][0] == 0.5
    out = tmp_path / "r.html"
    save_html([gantt_figure(timeline()), fig], str(out), intro="hello")
    text = out.read_text()
    assert text.count("plotly.js") >= 1 and "hello" in text


def test_the_budget_marker_shows_only_where_there_is_a_budget() -> None:
    from vpipe_lab.charts.figures import memory_figure

    none = memory_figure(2, None).data[3]
    assert none.name == "budget" and none.visible is False and list(none.y) == [None, None]
    some = memory_figure(2, [2**30, 0]).data[3]
    assert some.visible is True and list(some.y) == [1.0, None]


def test_specs_are_plain_json_and_fit_any_width() -> None:
    import json

    from vpipe_lab.charts.figures import gantt_spec, memory_spec, series_spec
    from vpipe_lab.core.timeline import Span, Timeline

    t = Timeline((Span(0, "forward", 0, None, 0.0, 1.0), Span(1, "backward", 0, None, 1.0, 2.0, replica=1)))
    gantt = gantt_spec(t, stages=2)
    assert gantt["layout"]["yaxis"]["ticktext"] == ["r0 stage 0", "r0 stage 1", "r1 stage 0", "r1 stage 1"]
    backward = next(tr for tr in gantt["data"] if tr["name"] == "backward")
    assert backward["y"][:2] == [lane(1, "backward", 1, 2)] * 2 == [3.0, 3.0]
    series = series_spec([{"iteration": 0, "loss": float("nan"), "samples_per_s": 5.0, "grad_norm": None}])
    assert series["data"][0]["y"] == [None] and series["data"][3]["showlegend"] is False
    mem = memory_spec(["stage 0"], [None], [[1.0], [2.0], [0.0], [0.0]])
    for spec in (gantt, series, mem):
        json.dumps(spec, allow_nan=False)
        assert spec["layout"]["autosize"] and "width" not in spec["layout"]
        assert spec["layout"]["legend"]["orientation"] == "h"  # under the plot, wrapping: never cut off on the right
    assert mem["data"][3]["visible"] is False  # no budget, no marker
