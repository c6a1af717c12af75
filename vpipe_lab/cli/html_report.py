"""The HTML report of `vpipe-lab run --report`: what produced it, a summary, the plan's table, the measured timeline,
memory per stage beside the planner's peaks, loss and throughput, and a mixture-of-experts model's load."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from vpipe_lab.core.cost.breakdown import bottleneck, breakdown
from vpipe_lab.core.plan import Estimate
from vpipe_lab.core.report import human_time

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class Provenance:
    """What produced a run: the command line, the model, the plan in force and its version, when it finished."""

    command: str
    model: str
    plan: str
    plan_version: int
    finished: str  # ISO 8601, local time with its offset

    def lines(self) -> list[str]:
        try:
            lab = version("vpipe-lab")
        except PackageNotFoundError:  # a checkout run without installing it
            lab = "(not installed)"
        return [f"command:   {self.command}", f"model:     {self.model}",
                f"plan:      v{self.plan_version} {self.plan}", f"finished:  {self.finished}  (vpipe_lab {lab})"]


def summary(frame: Any, timeline: Any, est: Estimate) -> list[str]:
    """Loss first to last, the measured iteration (median of the steady ones) against the cost model's, and the
    bottleneck stage measured (the most time on the critical path) beside the predicted one."""
    losses = [x for x in frame["loss"].tolist() if isinstance(x, float) and math.isfinite(x)]
    steady = frame["time_s"].tolist()[min(2, len(frame) - 1):]  # the first iterations warm up
    measured = statistics.median(steady) if steady else float("nan")
    out = [f"iterations: {len(frame)} (to iteration {int(frame['iteration'].iloc[-1])})"]
    if losses:
        out.append(f"loss:       {losses[0]:.4f} -> {losses[-1]:.4f}")
    ratio = measured / est.iteration_s if est.iteration_s else float("nan")
    out.append(f"iteration:  measured {human_time(measured)} (median), predicted {human_time(est.iteration_s)} "
               f"(measured/predicted {ratio:.2f})")
    rate = frame["samples_per_s"].tolist()[min(2, len(frame) - 1):]
    if rate and all(isinstance(x, float) and math.isfinite(x) for x in rate):
        out.append(f"throughput: {statistics.median(rate):.1f} samples/s")
    seen = bottleneck(breakdown(timeline)) if len(timeline.spans) else None
    out.append(f"bottleneck: stage {seen if seen is not None else '?'} measured, stage {est.bottleneck} predicted")
    return out


def _readable(figure: Any) -> None:
    """Axis labels, ticks and legends get the room they need (none cut at the page's edge)."""
    figure.update_xaxes(automargin=True)
    figure.update_yaxes(automargin=True)
    figure.update_layout(margin={"l": 72, "r": 24, "t": 96, "b": 56}, title={"y": 0.98, "yanchor": "top"},
                         legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
                         height=max(figure.layout.height or 0, 380))


def _memory(session: Any, memory: Any, predicted: list[Any]) -> Any:
    """Measured memory per stage (its largest rank), the planner's peak beside it, in MiB where every value is under
    a GiB (a CPU toy's 12 MiB is not 0.012 GiB)."""
    from vpipe_lab.charts.figures import memory_figure, memory_values

    last = memory[memory["iteration"] == memory["iteration"].max()]
    if "allocated_peak" in last:  # by stage: the rank that held the most (a sharded stage's ranks hold alike)
        last = last.sort_values("allocated_peak", ascending=False, na_position="last")
    last = last.drop_duplicates("stage").sort_values("stage")
    mem = memory_figure(session.plan.stages, [b if isinstance(b, int) else 0 for b in last["budget"].fillna(0)],
                        title="measured memory per stage (its largest rank)")
    static = last["static"].tolist()
    held = last["allocated_peak"].tolist() if "allocated_peak" in last else [None] * len(last)
    counted = (static + last["activations"]).tolist()
    values = memory_values(static, last["resident"].tolist(),
                           [h if h == h and h else c for h, c in zip(held, counted)], last["host"].tolist())
    for trace, ys in zip((mem.data[0], mem.data[1], mem.data[2], mem.data[4]), values):
        trace.y = ys
    mem.data[5].y, mem.data[5].visible = [p / GIB if p == p and p else None for p in predicted], True
    tops = [sum(v[i] for v in values[:3]) for i in range(len(static))] + [y for y in mem.data[5].y if y] + [
        y for y in mem.data[3].y if y]
    if max(tops, default=0.0) < 1.0:
        for trace in mem.data:
            trace.y = [None if y is None else y * (GIB / MIB) for y in trace.y]
        mem.update_yaxes(title_text="MiB")
    mem.update_layout(height=380)
    return mem


def write_report(path: str, session: Any, timeline: Any, frame: Any, memory: Any, est: Estimate, profile: Any,
                 predicted: list[Any], provenance: Provenance) -> None:
    """The run's HTML report; ``predicted`` is each stage's planned peak (its largest rank's)."""
    from vpipe_lab.charts.figures import figure, gantt_figure, save_html, series_spec
    from vpipe_lab.core.report import plan_table

    gantt = gantt_figure(timeline.with_idle(), title="measured timeline (last iterations)",
                         stages=session.plan.stages)
    series = figure(series_spec(frame.to_dict("records"), session.metrics.evaluation_records(),
                                title="loss and throughput per iteration"))
    series.update_layout(height=400)
    figures = [gantt, _memory(session, memory, predicted), series]
    rows = session.metrics.expert_records()
    if rows:  # a mixture-of-experts model: tokens per expert over the whole run
        import plotly.graph_objects as go

        from vpipe_lab.charts.expert_load import experts_spec

        figures.append(go.Figure(experts_spec(rows, title=f"experts' load over {len(frame)} iterations (share of "
                                                          "each layer's tokens)")))
    for fig in figures:
        _readable(fig)
    intro = "\n".join([*provenance.lines(), "", *summary(frame, timeline, est), "",
                       plan_table(session.plan, est, profile)])
    save_html(figures, path, title="vpipe_lab run report", intro=intro)
