"""Plotly figures of timelines and memory, shared by the live dashboard, the CLI's HTML reports and the notebooks.

The Gantt chart draws every kind of span as one thick ``scattergl`` line broken by gaps (None, which plotly draws as
a gap and, unlike NaN, is valid JSON on the widget channel): a handful of traces whatever the number of spans, far
cheaper to update than one bar per span (thousands of bar shapes make a FigureWidget update take seconds).
Measured and simulated timelines go through the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vpipe_lab.core.timeline import ASYNC_KINDS, KINDS, Timeline

COLORS = {
    "forward": "#4C78A8", "backward": "#F58518", "recompute": "#E45756", "swap_out": "#72B7B2", "swap_in": "#54A24B",
    "send": "#B279A2", "recv": "#FF9DA6", "idle": "#D8D8D8", "migrate": "#9D755D",
}
_COPY_OFFSET = 0.32  # the copy-engine lane sits just below its stage's compute lane


def lane(stage: int, kind: str) -> float:
    return stage + (_COPY_OFFSET if kind in ASYNC_KINDS else 0.0)


def gantt_data(timeline: Timeline, *, origin: float | None = None, unit: float = 1e3) -> dict[str, dict[str, list[Any]]]:
    """Per kind, the x/y/text arrays of its line trace (times relative to ``origin``, in ms by default)."""
    start = timeline.start_s if origin is None else origin
    data: dict[str, dict[str, list[Any]]] = {k: {"x": [], "y": [], "text": []} for k in KINDS}
    for s in timeline.spans:
        d = data[s.kind]
        y = lane(s.stage, s.kind)
        label = (f"{s.kind} it{s.iteration} mb{s.microbatch}" + (f" L{s.layer}" if s.layer is not None else "")
                 + f" {1e3 * s.duration_s:.2f} ms")
        d["x"].extend(((s.start_s - start) * unit, (s.end_s - start) * unit, None))
        d["y"].extend((y, y, None))
        d["text"].extend((label, label, ""))
    return data


def gantt_figure(timeline: Timeline, *, title: str = "pipeline timeline", widget: bool = False,
                 stages: int | None = None) -> Any:
    """A per-stage Gantt chart: compute lane per stage, copy lane (swaps) below it."""
    import plotly.graph_objects as go

    n = max(stages or 0, timeline.stages, 1)
    data = gantt_data(timeline)
    traces = [
        go.Scattergl(x=data[k]["x"], y=data[k]["y"], text=data[k]["text"], name=k, mode="lines",
                     line={"color": COLORS[k], "width": 14}, hoverinfo="text", connectgaps=False)
        for k in KINDS
    ]
    fig = (go.FigureWidget if widget else go.Figure)(data=traces)
    fig.update_layout(
        title=title, height=120 + 60 * n, margin={"l": 70, "r": 20, "t": 40, "b": 40},
        xaxis_title="time (ms)", legend={"orientation": "h", "y": -0.25}, uirevision="gantt",
    )
    fig.update_yaxes(tickvals=list(range(n)), ticktext=[f"stage {s}" for s in range(n)], autorange="reversed",
                     range=[n - 0.5, -0.5])
    return fig


def memory_figure(stages: int, budgets: Sequence[int] | None = None, *, widget: bool = False,
                  title: str = "memory per stage") -> Any:
    """Stacked bars of static, resident-activation and peak memory per stage (GiB), the budget as a marker line."""
    import plotly.graph_objects as go

    names = [f"stage {s}" for s in range(stages)]
    zeros = [0.0] * stages
    traces = [
        go.Bar(x=names, y=zeros, name="params+grads+optimizer", marker_color="#4C78A8"),
        go.Bar(x=names, y=zeros, name="activations", marker_color="#F58518"),
        go.Bar(x=names, y=zeros, name="peak transient", marker_color="#FFBF79"),
        # No budget, no marker: a stage without one gets a gap, not a red line at 0.
        go.Scatter(x=names, y=[b / 2**30 if b else None for b in budgets] if budgets else [None] * stages,
                   name="budget", mode="markers", visible=bool(budgets and any(budgets)),
                   marker={"symbol": "line-ew-open", "size": 40, "color": "#E45756", "line": {"width": 3}}),
        go.Bar(x=names, y=zeros, name="swapped to host", marker_color="#72B7B2", visible="legendonly"),
    ]
    fig = (go.FigureWidget if widget else go.Figure)(data=traces)
    fig.update_layout(barmode="stack", title=title, yaxis_title="GiB", height=300,
                      margin={"l": 60, "r": 20, "t": 40, "b": 30}, uirevision="memory")
    return fig


def memory_values(static: Sequence[float], activations: Sequence[float], peak: Sequence[float],
                  host: Sequence[float]) -> list[list[float]]:
    """The y arrays of ``memory_figure``'s bars, in GiB: peak is drawn as what it adds above the resident bytes."""
    gib = float(2**30)
    transient = [max(0.0, p - s - a) for s, a, p in zip(static, activations, peak)]
    return [[s / gib for s in static], [a / gib for a in activations], [t / gib for t in transient],
            [h / gib for h in host]]


def save_html(figures: Sequence[Any], path: str, title: str = "vpipe_lab report", intro: str = "") -> None:
    """Write figures into one self-contained HTML page (plotly.js inlined once, so it opens offline)."""
    parts = []
    for i, fig in enumerate(figures):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    body = "\n".join(parts)
    html = (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
            f"<body style='font-family:sans-serif'><h2>{title}</h2><pre>{intro}</pre>{body}</body></html>")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(html)
