from pathlib import Path

from vpipe_lab.charts.figures import gantt_data, gantt_figure, lane, memory_figure, memory_values, save_html
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster
from vpipe_lab.core.simulator import simulate
from vpipe_lab.core.timeline import KINDS
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
