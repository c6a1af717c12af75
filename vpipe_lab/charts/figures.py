"""Plotly figures of timelines, memory and training curves, shared by the live dashboard, the CLI's HTML reports and
the notebooks.

Every chart is first a plain figure dict (``{"data": [...], "layout": {...}}``, plotly.js's own JSON): the live
dashboard sends it to the browser as it is, several times a second, without building plotly objects; reports and
notebooks wrap the same dict in a ``plotly.graph_objects.Figure``. The Gantt chart draws every kind of span as one
thick line broken by gaps (None, which plotly draws as a gap and, unlike NaN, is valid JSON on the widget channel): a
handful of traces whatever the number of spans, far cheaper to draw than one bar per span. Measured and simulated
timelines go through the same code; a job with several pipeline replicas gets a lane per (replica, stage), and a
stage with several virtual stages (interleaved 1F1B) a compute lane per chunk inside its own: the chunks share the
stage's compute stream, so its idle time is drawn on each of them.
Layouts leave the width to the page (``autosize``) and put legends under the plot, so a figure fits any output area.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from vpipe_lab.core.timeline import ASYNC_KINDS, KINDS, Span, Timeline

COLORS = {
    "forward": "#4C78A8", "backward": "#F58518", "wgrad": "#EECA3B", "recompute": "#E45756", "swap_out": "#72B7B2",
    "swap_in": "#54A24B", "send": "#B279A2", "recv": "#FF9DA6", "idle": "#D8D8D8", "migrate": "#9D755D",
    "all_gather": "#17BECF", "reduce_scatter": "#8C564B",
}
_COPY_OFFSET = 0.32  # the copy-engine lane sits just below its stage's compute lane
# Under the plot, left-aligned; plotly wraps it into rows and grows the bottom margin to fit them. Axis titles that
# would sit where the legend goes are carried by the ticks instead (" ms"), so the two never overlap.
_LEGEND = {"orientation": "h", "x": 0, "xanchor": "left", "y": -0.08, "yanchor": "top"}
Fig = dict[str, Any]


def chunk_offset(chunk: int, chunks: int) -> float:
    """Where chunk ``chunk`` of a stage's ``chunks`` sits in the stage's lane (0 with one chunk): spread above the
    copy lane, the first chunk on top."""
    return 0.0 if chunks <= 1 else -0.3 + chunk * 0.42 / (chunks - 1)


def lane(stage: int, kind: str, replica: int = 0, stages: int = 1, chunk: int = 0, chunks: int = 1) -> float:
    """The y of a span's lane: one per (replica, stage), the copy lane just below its compute lane, and with several
    chunks per stage a compute lane per chunk."""
    base = replica * stages + stage
    return base + (_COPY_OFFSET if kind in ASYNC_KINDS else chunk_offset(chunk, chunks))


def lane_names(stages: int, replicas: int = 1) -> list[str]:
    return [f"stage {s}" if replicas == 1 else f"r{r} stage {s}" for r in range(replicas) for s in range(stages)]


def _ticks(stages: int, replicas: int, chunks: int) -> tuple[list[float], list[str]]:
    """The y-axis ticks: a stage's name, or with several chunks each chunk's lane named (``stage 0 · c1``)."""
    names = lane_names(stages, replicas)
    if chunks <= 1:
        return [float(i) for i in range(len(names))], names
    return ([i + chunk_offset(c, chunks) for i in range(len(names)) for c in range(chunks)],
            [f"{name} · c{c}" for name in names for c in range(chunks)])


def gantt_data(timeline: Timeline, *, origin: float | None = None, unit: float = 1e3,
               stages: int | None = None) -> dict[str, dict[str, list[Any]]]:
    """Per kind, the x/y/text arrays of its line trace (times relative to ``origin``, in ms by default)."""
    start = timeline.start_s if origin is None else origin
    per_replica = max(stages or 0, timeline.stages, 1)
    chunks = timeline.chunks
    data: dict[str, dict[str, list[Any]]] = {k: {"x": [], "y": [], "text": []} for k in KINDS}
    for s in timeline.spans:
        d = data[s.kind]
        label = (f"{s.kind} it{s.iteration} mb{s.microbatch}" + (f" L{s.layer}" if s.layer is not None else "")
                 + (f" chunk {s.chunk}" if chunks > 1 else "") + f" {1e3 * s.duration_s:.2f} ms")
        # the stage's own time (idle, a migration) belongs to every chunk's lane
        for c in range(chunks) if chunks > 1 and s.kind in ("idle", "migrate") else (s.chunk,):
            y = lane(s.stage, s.kind, s.replica, per_replica, c, chunks)
            d["x"].extend(((s.start_s - start) * unit, (s.end_s - start) * unit, None))
            d["y"].extend((y, y, None))
            d["text"].extend((label, label, ""))
    return data


def gantt_spec(timeline: Timeline, *, title: str = "pipeline timeline", stages: int | None = None,
               replicas: int | None = None, path: Sequence[Span] = ()) -> Fig:
    """A per-stage Gantt chart (per replica and stage with several replicas): a compute lane per stage (per chunk of
    the stage with virtual stages), a copy lane (swaps) below it, as a plain figure dict. ``path`` (an iteration's
    critical path, ``core/cost/critical_path.py``) is drawn over it as one thin dark line through its spans."""
    n = max(stages or 0, timeline.stages, 1)
    r = max(replicas or 0, timeline.replicas, 1)
    v = timeline.chunks
    data = gantt_data(timeline, stages=n)
    width = 14 if r * n <= 8 and v == 1 else 8
    traces = [
        {"type": "scatter", "x": data[k]["x"], "y": data[k]["y"], "text": data[k]["text"], "name": k,
         "mode": "lines", "line": {"color": COLORS[k], "width": width}, "hoverinfo": "text",
         "connectgaps": False}  # plotly leaves a trace without points out of the legend
        for k in KINDS
    ]
    if path:
        traces.append(_path_trace(path, timeline.start_s, n, v))
    lanes = r * n
    tickvals, ticktext = _ticks(n, r, v)
    layout = {
        "title": {"text": title}, "height": 150 + (44 if v == 1 else 30 + 14 * v) * lanes, "autosize": True,
        "margin": {"l": (80 if r > 1 else 64) + (40 if v > 1 else 0), "r": 16, "t": 40, "b": 40},
        "xaxis": {"ticksuffix": " ms", "zeroline": False},
        "yaxis": {"tickvals": tickvals, "ticktext": ticktext, "range": [lanes - 0.5, -0.5], "zeroline": False},
        "legend": _LEGEND, "uirevision": "gantt", "hovermode": "closest",
    }
    return {"data": traces, "layout": layout}


def _path_trace(path: Sequence[Span], origin: float, stages: int, chunks: int) -> dict[str, Any]:
    """The critical path: along each of its spans on the span's lane, and across to the next span's lane."""
    xs: list[float | None] = []
    ys: list[float | None] = []
    for s in path:
        y = lane(s.stage, s.kind, s.replica, stages, s.chunk, chunks)
        xs += [(s.start_s - origin) * 1e3, (s.end_s - origin) * 1e3]
        ys += [y, y]
    return {"type": "scatter", "mode": "lines", "x": xs, "y": ys, "name": "critical path", "hoverinfo": "name",
            "line": {"color": "#222222", "width": 2}}


def memory_values(static: Sequence[float], activations: Sequence[float], peak: Sequence[float],
                  host: Sequence[float]) -> list[list[float]]:
    """The y arrays of the memory chart's bars, in GiB: peak is drawn as what it adds above the resident bytes."""
    gib = float(2**30)
    transient = [max(0.0, p - s - a) for s, a, p in zip(static, activations, peak)]
    return [[s / gib for s in static], [a / gib for a in activations], [t / gib for t in transient],
            [h / gib for h in host]]


def memory_spec(names: Sequence[str], budgets: Sequence[int | None] | None = None,
                values: Sequence[Sequence[float]] | None = None, *, title: str = "memory per stage",
                predicted: Sequence[int | None] | None = None) -> Fig:
    """Stacked bars of static, resident-activation and peak memory per stage (GiB; ``values`` as ``memory_values``
    gives them), the budget as a marker line where a stage has one, and the planner's ``predicted`` peak (bytes) as a
    diamond beside the measured bar where there is one."""
    zeros = [0.0] * len(names)
    static, resident, transient, host = values if values is not None else (zeros, zeros, zeros, zeros)
    marks = [b / 2**30 if b else None for b in budgets] if budgets else [None] * len(names)
    guess = [p / 2**30 if p else None for p in predicted] if predicted else [None] * len(names)
    bar = {"type": "bar", "x": list(names)}
    traces = [
        {**bar, "y": list(static), "name": "params+grads+optimizer", "marker": {"color": "#4C78A8"}},
        {**bar, "y": list(resident), "name": "activations", "marker": {"color": "#F58518"}},
        {**bar, "y": list(transient), "name": "peak transient", "marker": {"color": "#FFBF79"}},
        # No budget, no marker: a stage without one gets a gap, not a red line at 0.
        {"type": "scatter", "x": list(names), "y": marks, "name": "budget", "mode": "markers",
         "visible": any(m is not None for m in marks),
         "marker": {"symbol": "line-ew-open", "size": 40, "color": "#E45756", "line": {"width": 3}}},
        {**bar, "y": list(host), "name": "swapped to host", "marker": {"color": "#72B7B2"}, "visible": "legendonly"},
        {"type": "scatter", "x": list(names), "y": guess, "name": "predicted peak", "mode": "markers",
         "visible": any(g is not None for g in guess),
         "marker": {"symbol": "diamond-open", "size": 12, "color": "#54A24B", "line": {"width": 2}}},
    ]
    layout = {"barmode": "stack", "title": {"text": title}, "yaxis": {"title": {"text": "GiB"}, "rangemode": "tozero"},
              "height": 330, "autosize": True, "margin": {"l": 56, "r": 16, "t": 40, "b": 40}, "legend": _LEGEND,
              "uirevision": "memory"}
    return {"data": traces, "layout": layout}


def finite(x: Any) -> float | None:
    """NaN and infinities become gaps: they are not valid JSON on the widget channel."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def series_spec(records: Sequence[Mapping[str, Any]], evaluations: Sequence[Mapping[str, Any]] = (), *,
                title: str = "loss and throughput") -> Fig:
    """Loss, samples/s (right axis), evaluation loss and gradient norm per iteration."""
    xs = [r["iteration"] for r in records]
    line = {"type": "scatter", "mode": "lines", "x": xs}
    norms = [finite(r.get("grad_norm")) for r in records]
    traces = [
        {**line, "y": [finite(r.get("loss")) for r in records], "name": "loss", "line": {"color": "#4C78A8"}},
        {**line, "y": [finite(r.get("samples_per_s")) for r in records], "name": "samples/s", "yaxis": "y2",
         "line": {"color": "#F58518"}},
        {"type": "scatter", "mode": "markers", "x": [e["iteration"] for e in evaluations],
         "y": [finite(e.get("loss")) for e in evaluations], "name": "eval loss",
         "marker": {"color": "#54A24B", "size": 8}},
        # Only measured when the job clips or asks for it: no legend entry for a line that has no point.
        {**line, "y": norms, "name": "grad norm", "line": {"color": "#B279A2", "dash": "dot"},
         "showlegend": any(n is not None for n in norms)},
    ]
    layout = {"title": {"text": title}, "height": 330, "autosize": True, "uirevision": "series",
              "xaxis": {"tickprefix": "it ", "rangemode": "tozero"}, "margin": {"l": 56, "r": 16, "t": 40, "b": 40},
              "yaxis": {"title": {"text": "loss"}, "automargin": True},
              "yaxis2": {"title": {"text": "samples/s"}, "overlaying": "y", "side": "right", "automargin": True,
                         "rangemode": "tozero", "showgrid": False, "tickmode": "auto", "nticks": 6,
                         "tickformat": ".3~s"},
              "legend": _LEGEND}
    return {"data": traces, "layout": layout}


def figure(spec: Fig) -> Any:
    """A ``plotly.graph_objects.Figure`` of a figure dict (for reports and notebooks)."""
    import plotly.graph_objects as go

    return go.Figure(spec)


def gantt_figure(timeline: Timeline, *, title: str = "pipeline timeline", stages: int | None = None) -> Any:
    """``gantt_spec`` as a plotly Figure."""
    return figure(gantt_spec(timeline, title=title, stages=stages))


def memory_figure(stages: int, budgets: Sequence[int | None] | None = None, *, title: str = "memory per stage") -> Any:
    """``memory_spec`` for ``stages`` stages as a plotly Figure (fill its bars with ``memory_values``)."""
    return figure(memory_spec([f"stage {s}" for s in range(stages)], budgets, title=title))


def save_html(figures: Sequence[Any], path: str, title: str = "vpipe_lab report", intro: str = "") -> None:
    """Write figures into one self-contained HTML page (plotly.js inlined once, so it opens offline)."""
    import html

    parts = []
    for i, fig in enumerate(figures):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    body = "\n".join(parts)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family:sans-serif'><h2>{html.escape(title)}</h2><pre>{html.escape(intro)}</pre>{body}"
            "</body></html>")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
