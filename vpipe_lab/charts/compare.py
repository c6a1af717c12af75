"""Figures of the session's record: two plans' measured iterations on one time scale, their splits side by side, and
every plan's measured against its predicted iteration time (plain figure dicts, as ``figures.py`` makes them)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from vpipe_lab.charts.figures import _LEGEND, COLORS, Fig, finite, gantt_data
from vpipe_lab.core.cost.breakdown import PARTS, StageTime
from vpipe_lab.core.timeline import KINDS, Timeline

PART_COLORS = {"compute": COLORS["forward"], "recompute": COLORS["recompute"], "swap": COLORS["swap_out"],
               "transfer": COLORS["send"], "bubble": COLORS["idle"]}


def pair_spec(a: Timeline | None, b: Timeline | None, labels: tuple[str, str], title: str | None = None) -> Fig:
    """Two iterations (measured or simulated), one above the other, each from its own start on the same millisecond
    axis and in the same colours: what one plan does that the other does not is where their bars differ."""
    stages = [max(t.stages, 1) if t is not None else 1 for t in (a, b)]
    gap = 1.0  # an empty lane between the two
    traces: list[dict[str, Any]] = []
    tickvals: list[float] = []
    ticktext: list[str] = []
    offset = 0.0
    for index, (timeline, label, n) in enumerate(zip((a, b), labels, stages)):
        if timeline is not None and len(timeline):
            data = gantt_data(timeline, stages=n)
            for kind in KINDS:
                d = data[kind]
                traces.append({"type": "scatter", "mode": "lines", "x": d["x"],
                               "y": [None if y is None else y + offset for y in d["y"]], "text": d["text"],
                               "name": kind, "legendgroup": kind, "showlegend": index == 0 or kind not in
                               {t["name"] for t in traces}, "line": {"color": COLORS[kind], "width": 12},
                               "hoverinfo": "text", "connectgaps": False})
        tickvals += [offset + s for s in range(n)]
        ticktext += [f"{label} · stage {s}" for s in range(n)]
        offset += n + gap
    lanes = offset - gap
    layout = {"title": {"text": title or f"{labels[0]} and {labels[1]}: their last measured iterations"},
              "height": 160 + 40 * lanes, "autosize": True, "margin": {"l": 150, "r": 16, "t": 40, "b": 40},
              "xaxis": {"ticksuffix": " ms", "zeroline": False, "rangemode": "tozero"},
              "yaxis": {"tickvals": tickvals, "ticktext": ticktext, "range": [lanes - 0.5, -0.5], "zeroline": False},
              "legend": _LEGEND, "uirevision": "pair", "hovermode": "closest"}
    return {"data": traces, "layout": layout}


def split_spec(a: Sequence[StageTime], b: Sequence[StageTime], labels: tuple[str, str]) -> Fig:
    """Each stage's iteration split into compute, recompute, swap, transfer and bubble (ms), the two plans' bars
    beside each other per stage."""
    xs = [f"stage {t.stage} · {label}" for split, label in ((a, labels[0]), (b, labels[1])) for t in split]
    order = sorted(range(len(xs)), key=lambda i: (int(xs[i].split()[1]), i))  # stage by stage, A then B
    rows = [*a, *b]
    traces = [{"type": "bar", "x": [xs[i] for i in order], "y": [finite(1e3 * rows[i].seconds(part)) for i in order],
               "name": part, "marker": {"color": PART_COLORS[part]}} for part in PARTS]
    layout = {"barmode": "stack", "title": {"text": "where each stage's iteration went"}, "height": 330,
              "autosize": True, "yaxis": {"ticksuffix": " ms", "rangemode": "tozero"},
              "margin": {"l": 64, "r": 16, "t": 40, "b": 40}, "legend": _LEGEND, "uirevision": "split"}
    return {"data": traces, "layout": layout}


def record_spec(rows: Sequence[Mapping[str, Any]]) -> Fig:
    """Every entry of the record: its median measured iteration time beside the cost model's prediction (ms)."""
    xs = [f"{r['entry']} {r['source']}" for r in rows]
    bar = {"type": "bar", "x": xs}
    traces = [
        {**bar, "y": [finite(1e3 * r["median_s"]) if r.get("median_s") else None for r in rows], "name": "measured",
         "marker": {"color": COLORS["forward"]}, "text": [r["plan"] for r in rows], "textposition": "none",
         "hoverinfo": "text+y"},  # the plan on hover only: written in the bar it runs sideways
        {**bar, "y": [finite(1e3 * r["predicted_s"]) if r.get("predicted_s") else None for r in rows],
         "name": "predicted when applied", "marker": {"color": COLORS["idle"]}},
    ]
    layout = {"barmode": "group", "title": {"text": "each plan: median iteration, measured and predicted"},
              "height": 330, "autosize": True, "yaxis": {"ticksuffix": " ms", "rangemode": "tozero"},
              "margin": {"l": 64, "r": 16, "t": 40, "b": 40}, "legend": _LEGEND, "uirevision": "record"}
    return {"data": traces, "layout": layout}


FAR = 20.0  # a budget this many times the largest peak is left off the peak chart's scale (and named in its title)


def peak_spec(current: Sequence[float], draft: Sequence[float] | None, budgets: Sequence[int | None]) -> Fig:
    """Each stage's predicted peak memory (GiB) under the running plan and the draft, the budget a line per stage."""
    gib = float(2**30)
    names = [f"stage {s}" for s in range(max(len(current), len(draft or [])))]
    bar = {"type": "bar", "x": names}
    marks = [b / gib if b else None for b in budgets] + [None] * (len(names) - len(budgets))
    traces = [
        {**bar, "y": [finite(p / gib) for p in current], "name": "running plan", "marker": {"color": COLORS["idle"]}},
        {**bar, "y": [finite(p / gib) for p in draft or []], "name": "draft", "marker": {"color": COLORS["forward"]},
         "visible": draft is not None},
        {"type": "scatter", "x": names, "y": marks, "name": "budget", "mode": "markers",
         "visible": any(m is not None for m in marks),
         "marker": {"symbol": "line-ew-open", "size": 40, "color": "#E45756", "line": {"width": 3}}},
    ]
    title, yaxis = "predicted peak memory per stage", {"title": {"text": "GiB"}, "rangemode": "tozero"}
    top = max([p / gib for p in [*current, *(draft or [])] if math.isfinite(p)] or [0.0])
    lowest = min((m for m in marks if m is not None), default=None)
    if lowest is not None and 0 < top and lowest > FAR * top:
        # a budget far above every peak (a whole device's memory) would flatten the bars to nothing: scale to the
        # bars and say where the budget is instead
        yaxis["range"] = [0.0, 1.25 * top]
        # on a line of its own, smaller: a half-width panel clips a long title
        title += f"<br><sub>budget {lowest:.3g} GiB a stage, off the scale: the largest peak is {top / lowest:.1%} of it</sub>"
    layout = {"barmode": "group", "title": {"text": title}, "height": 300, "autosize": True, "yaxis": yaxis,
              "margin": {"l": 56, "r": 16, "t": 56 if "<br>" in title else 40, "b": 40}, "legend": _LEGEND,
              "uirevision": "peaks"}
    return {"data": traces, "layout": layout}
