"""The live dashboard: per-stage Gantt of the latest iterations, memory per stage against the budget, loss and
throughput per iteration, as plotly FigureWidgets.

Session events only mark the dashboard dirty (a latest-value buffer); a refresher thread redraws at most ``rate_hz``
times a second, sending each figure's arrays once per refresh whatever the iteration rate, and keeps rolling windows
(the last ``window`` iterations of spans, the last ``points`` of loss), so it stays smooth over hours. Simulated
timelines are drawn by the same code (``show_timeline``). When the session ends (stopped, detached or failed) the
dashboard draws once more and stays on screen, frozen, saying so.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import pandas  # noqa: F401  (imported here, not first by plotly on the refresher thread while a cell imports it too)
import plotly.graph_objects as go

from vpipe_lab.charts.figures import gantt_data, gantt_figure, memory_figure, memory_values
from vpipe_lab.core.report import human_time
from vpipe_lab.core.timeline import KINDS, Timeline

if TYPE_CHECKING:
    from vpipe_lab.control.session import Session

log = logging.getLogger(__name__)


def loss_figure(widget: bool = True) -> Any:
    fig = (go.FigureWidget if widget else go.Figure)(data=[
        go.Scatter(x=[], y=[], mode="lines", name="loss", line={"color": "#4C78A8"}),
        go.Scatter(x=[], y=[], mode="lines", name="samples/s", yaxis="y2", line={"color": "#F58518"}),
        go.Scatter(x=[], y=[], mode="markers", name="eval loss", marker={"color": "#54A24B", "size": 8}),
        go.Scatter(x=[], y=[], mode="lines", name="grad norm", line={"color": "#B279A2", "dash": "dot"}),
    ])
    fig.update_layout(title="loss and throughput", height=300, xaxis_title="iteration", uirevision="loss",
                      margin={"l": 50, "r": 50, "t": 40, "b": 30}, legend={"orientation": "h", "y": -0.3},
                      yaxis={"title": "loss"}, yaxis2={"title": "samples/s", "overlaying": "y", "side": "right"})
    return fig


def _finite(x: Any) -> float | None:
    """NaN and infinities become gaps: they are not valid JSON on the widget channel."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


class Dashboard:
    """Live view of a Session; display it in a notebook cell (``%vpipe dashboard`` does)."""

    def __init__(self, session: Session, *, window: int = 3, rate_hz: float = 8.0, points: int = 500) -> None:
        if not 0 < rate_hz <= 10:
            raise ValueError(f"rate_hz must be in (0, 10] (the Jupyter server drops bursts of messages), got {rate_hz}")
        self.session = session
        self.window, self.points, self.period = window, points, 1.0 / rate_hz
        self.gantt = gantt_figure(Timeline(), title="measured timeline (latest iterations)", widget=True,
                                  stages=session.stages)
        budgets = [b or 0 for b in (session.spec.memory_budget or [0] * session.stages)]
        self.memory = memory_figure(session.stages, budgets, widget=True, title="memory per stage (GiB)")
        self.loss = loss_figure()
        self.header = widgets.HTML()
        self.widget = widgets.VBox([self.header, self.gantt, widgets.HBox([self.memory, self.loss])])
        self._dirty = threading.Event()
        self._closed = False
        self.ended = False  # the session ended: the view is frozen at its last state
        self.refreshes = 0
        self._unsubscribe = session.on_event(self._on_event)
        self._thread = threading.Thread(target=self._loop, name="vpipe-dashboard", daemon=True)
        self._thread.start()
        self._dirty.set()

    def _stop_listening(self) -> None:
        unsubscribe, self._unsubscribe = self._unsubscribe, lambda: None
        unsubscribe()

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("type") in ("closed", "failed"):
            self.ended = True  # the refresher draws the final state once more, then stops
        if event.get("type") in ("iteration", "plan", "model", "migrated", "error", "replan", "closed", "failed"):
            self._dirty.set()  # the data itself is read from session.metrics at the next refresh

    def _loop(self) -> None:
        while not self._closed:
            if self._dirty.wait(timeout=0.5) and not self._closed:
                self._dirty.clear()
                ended = self.ended
                try:
                    self.refresh()
                except Exception:
                    if self.widget.comm is None:  # the widget was closed: nothing left to draw on
                        return
                    log.warning("a dashboard refresh failed; the next event redraws it", exc_info=True)
                if ended:
                    self._stop_listening()
                    return
                time.sleep(self.period)  # at most rate_hz refreshes a second

    def refresh(self) -> None:
        """Redraw from the session's metrics (called by the refresher thread; callable by hand)."""
        s = self.session
        # Only the newest rows are read: a refresh costs the same after hours of training as after a minute.
        records = s.metrics.records(last=self.points)
        timeline = s.metrics.timeline(self.window).with_idle()
        latest = records[-1] if records else None
        mem = sorted(s.metrics.latest_memory(), key=lambda r: r["stage"])
        state = s.status
        if state in ("stopped", "failed"):
            state = ("<span style='color:#c0392b'>session ended: " + state + "</span>"
                     + (f" ({s.failure.cause.splitlines()[0]})" if s.failure is not None else "")
                     + "; this view is frozen at its last state")
        text = f"<b>vpipe_lab</b> - {state}, iteration {s.iteration}, plan v{s.plan_version}: {s.plan.describe()}"
        if latest:
            text += (f" - last iteration {human_time(latest['time_s'])}, loss {latest['loss']:.4f}"
                     + (f", {latest['samples_per_s']:.0f} samples/s" if latest.get("samples_per_s") else "")
                     + (f", grad norm {latest['grad_norm']:.3g}" if _finite(latest.get("grad_norm")) else "")
                     + (f", lr {latest['lr']:.3g}" if latest.get("lr") is not None else "")
                     + (" (fp16 overflow: step skipped)" if latest.get("skipped") else ""))
        self.header.value = text
        self.draw_timeline(timeline)
        if mem:
            static = [r["static"] for r in mem]
            values = memory_values(static, [r.get("resident", r["activations"]) for r in mem],
                                   [st + r["activations"] for st, r in zip(static, mem)], [r["host"] for r in mem])
            with self.memory.batch_update():
                for trace, ys in zip((self.memory.data[0], self.memory.data[1], self.memory.data[2],
                                      self.memory.data[4]), values):
                    trace.y = ys
        with self.loss.batch_update():
            xs = [r["iteration"] for r in records]
            self.loss.data[0].x, self.loss.data[0].y = xs, [_finite(r["loss"]) for r in records]
            self.loss.data[1].x, self.loss.data[1].y = xs, [_finite(r.get("samples_per_s")) for r in records]
            evals = s.metrics.evaluation_records()[-self.points:]
            self.loss.data[2].x, self.loss.data[2].y = [e["iteration"] for e in evals], [_finite(e["loss"])
                                                                                          for e in evals]
            self.loss.data[3].x, self.loss.data[3].y = xs, [_finite(r.get("grad_norm")) for r in records]
        self.refreshes += 1

    def draw_timeline(self, timeline: Timeline, title: str | None = None) -> None:
        data = gantt_data(timeline)
        with self.gantt.batch_update():
            for trace, kind in zip(self.gantt.data, KINDS):
                trace.x, trace.y, trace.text = data[kind]["x"], data[kind]["y"], data[kind]["text"]
            if title:
                self.gantt.layout.title = title

    def show_timeline(self, timeline: Timeline, title: str = "simulated timeline") -> Any:
        """A simulated (what-if) or saved timeline in a figure of its own, drawn like the live one."""
        return gantt_figure(timeline, title=title, widget=True, stages=self.session.stages)

    def close(self) -> None:
        self._closed = True
        self._dirty.set()
        self._stop_listening()
        self.widget.close()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)
