"""The live dashboard of a Session: per-stage Gantt of the latest iterations (every pipeline replica's lanes), memory
per stage against the budget, loss and throughput per iteration, and for a mixture-of-experts model the tokens each
expert of each layer received over the last iterations (see live_view.py for the widget).

Session events only mark the dashboard dirty (a latest-value buffer); a refresher thread redraws at most ``rate_hz``
times a second, sending each panel once per refresh whatever the iteration rate, and keeps rolling windows (the last
``window`` iterations of spans, the last ``points`` of loss), so it stays smooth over hours. Simulated timelines are
drawn by the same code (``show_timeline``). When the session ends (stopped, detached or failed) the dashboard draws
once more and stays on screen, frozen, saying so.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from vpipe_lab.charts.expert_load import experts_spec
from vpipe_lab.charts.figures import figure, finite, gantt_spec, lane_names, memory_spec, memory_values, series_spec
from vpipe_lab.core.cost.breakdown import bottleneck, breakdown
from vpipe_lab.core.cost.critical_path import CriticalPath, critical_path
from vpipe_lab.core.report import human_time
from vpipe_lab.core.timeline import Timeline
from vpipe_lab.jupyter.live_view import LiveView

if TYPE_CHECKING:
    from vpipe_lab.control.session import Session

log = logging.getLogger(__name__)
LIVE_TITLE = "measured timeline (latest iterations)"
MAX_SPANS = 1000  # spans a frame draws at most (whole iterations; one iteration of a very wide pipeline may exceed)
# What one display sends the browser a second at most, averaged over a frame and the wait after it: three dashboards
# stay under a megabyte a second (a remote notebook's link), whatever the pipeline's width.
MAX_BYTES_PER_S = 250_000
EXPERT_ITERATIONS = 10  # the experts' load panel sums the newest iterations' tokens: one iteration alone is noisy


class Dashboard:
    """Live view of a Session; display it in a notebook cell (``%vpipe dashboard`` does)."""

    def __init__(self, session: Session, *, window: int = 3, rate_hz: float = 8.0, points: int = 500,
                 bytes_per_s: float = MAX_BYTES_PER_S) -> None:
        if not 0 < rate_hz <= 10:
            raise ValueError(f"rate_hz must be in (0, 10] (the Jupyter server drops bursts of messages), got {rate_hz}")
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be positive (what one display may send the browser a second), got "
                             f"{bytes_per_s!r}")
        self.session = session
        self.window, self.points, self.period, self.bytes_per_s = window, points, 1.0 / rate_hz, bytes_per_s
        self.replicas = int(session.plan.data_parallel)  # each data-parallel pipeline (shard, replica) its lanes
        self.widget = LiveView()
        self._dirty = threading.Event()
        self._closed = False
        self.ended = False  # the session ended: the view is frozen at its last state
        self.refreshes = 0
        self._predicted: tuple[object, list[int | None]] = (None, [])  # (plan version, second) -> peaks per stage
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
        if event.get("type") in ("iteration", "plan", "model", "migrated", "error", "replan", "closed", "failed",
                                 "restarting", "restarted"):
            self._dirty.set()  # the data itself is read from session.metrics at the next refresh

    def _loop(self) -> None:
        while not self._closed:
            if self._dirty.wait(timeout=0.5) and not self._closed:
                self._dirty.clear()
                ended = self.ended
                sent = self.widget.sent_bytes
                try:
                    self.refresh()
                except Exception:
                    if self.widget.comm is None:  # the widget was closed: nothing left to draw on
                        return
                    log.warning("a dashboard refresh failed; the next event redraws it", exc_info=True)
                if ended:
                    self._stop_listening()
                    return
                # at most rate_hz refreshes a second, and a big frame waits until the display is within its bytes
                time.sleep(max(self.period, (self.widget.sent_bytes - sent) / self.bytes_per_s))

    # --- what is drawn ----------------------------------------------------------------------------------------------
    def header(self, timeline: Timeline | None = None, path: CriticalPath | None = None) -> dict[str, Any]:
        """The header line: the session's state, why it ended if it failed, the last iteration, the bottleneck
        stage with its split of the recent iterations in ``timeline`` (``core/cost/breakdown.py``), and the newest
        iteration's critical path (``path``, else walked from ``timeline``: ``core/cost/critical_path.py``; drawn on
        the timeline too)."""
        s = self.session
        latest = s.metrics.latest()
        state = s.status
        detail = s.failure.cause.splitlines()[0] if s.failure is not None and s.failure.cause else ""
        text = f"iteration {s.iteration}, plan v{s.plan_version}: {s.plan.describe()}"
        engine = getattr(getattr(s, "settings", None), "engine", "lab")  # the job spec has none: never named before
        if engine != "lab":  # whose runtime trains it (launch(engine=...))
            text += f" on {engine}'s engine"
        if latest:
            text += (f" - last iteration {human_time(latest['time_s'])}, loss {latest['loss']:.4f}"
                     + (f", {latest['samples_per_s']:.0f} samples/s" if finite(latest.get("samples_per_s")) else "")
                     + (f", grad norm {latest['grad_norm']:.3g}" if finite(latest.get("grad_norm")) else "")
                     + (f", lr {latest['lr']:.3g}" if latest.get("lr") is not None else "")
                     + (" (step skipped: an fp16 overflow or a non-finite loss)" if latest.get("skipped") else ""))
        times = breakdown(timeline) if timeline is not None else []
        worst = bottleneck(times)
        if worst is not None and s.plan.stages > 1:
            # the stage whose work bounds the iteration (most of the critical path), the part its work is most of,
            # and its waiting: the rule session.breakdown() and the report use (core/cost/breakdown.py)
            t = times[worst]
            part = t.share("compute") + t.share("recompute") if t.dominant == "compute" else t.share(t.dominant)
            text += (f" - bottleneck: stage {worst} ({t.dominant} {part:.0%}, waiting {t.share('bubble'):.0%}; "
                     f"pipeline bubble "
                     f"{sum(x.bubble_s for x in times) / max(1e-12, sum(x.iteration_s for x in times)):.0%})")
            path = path if path is not None else critical_path(timeline)
            if path.spans:
                text += (f" - critical path {human_time(path.seconds)} through stages "
                         f"{'>'.join(map(str, path.stages()))}, {path.share(stage=worst):.0%} of it on stage {worst}")
        restarts = s.metrics.restart_records()
        if restarts:  # launch(max_restarts=N): the job carried on; say how often and what the last one cost
            r = restarts[-1]
            text += (f" - restarts: {len(restarts)} (last: stage {r['stage']}, {r['cause'].split(' (')[0]}; back to "
                     f"iteration {r['snapshot']}, {r['replayed']} replayed"
                     + (f"; stage {r['stage']} could not come back: {r['stages']} stages now)" if r.get("note") else ")"))
        if state in ("stopped", "failed"):
            text += " - session ended: this view is frozen at its last state"
        return {"state": state, "detail": detail, "text": text}

    def predicted_peaks(self) -> list[int | None]:
        """The planner's predicted peak per stage for the plan in force over the profile in hand (None before one
        was measured), computed again when the plan or the profile changes, at most once a second."""
        s = self.session
        key = (s.plan_version, int(time.monotonic()))
        if self._predicted[0] != key:
            try:
                frame = s.memory(ask=False)  # asks the workers for nothing
                peaks = [None if v is None or v != v else int(v) for v in frame["predicted_peak"]]
            except Exception:  # a prediction the cost model cannot make must not stop the live view
                log.debug("no predicted memory for the dashboard", exc_info=True)
                peaks = []
            self._predicted = (key, peaks)
        return self._predicted[1]

    def memory_figure(self) -> dict[str, Any]:
        s = self.session
        rows = sorted(s.metrics.latest_memory(), key=lambda r: (int(r.get("replica", 0)), int(r["stage"])))
        budget = list(s.settings.budgets or [None] * s.plan.stages)
        if rows:
            names = [f"stage {r['stage']}" if self.replicas == 1 else f"r{r.get('replica', 0)} stage {r['stage']}"
                     for r in rows]
            static = [r["static"] for r in rows]
            # the bar's top is what the allocator held at its most (independent of the prediction), else the count
            peaks = [r.get("allocated_peak") or st + r["activations"] for st, r in zip(static, rows)]
            values = memory_values(static, [r.get("resident", r["activations"]) for r in rows], peaks,
                                   [r["host"] for r in rows])
            budgets = [budget[int(r["stage"])] for r in rows]
            guess = self.predicted_peaks()
            predicted = [guess[int(r["stage"])] if int(r["stage"]) < len(guess) else None for r in rows]
            return memory_spec(names, budgets, values, title="memory per stage (GiB)", predicted=predicted)
        names = lane_names(s.plan.stages, self.replicas)
        return memory_spec(names, budget * self.replicas, title="memory per stage (GiB)")

    def refresh(self) -> int:
        """Redraw from the session's metrics (called by the refresher thread; callable by hand); returns the frame."""
        s = self.session
        # Only the newest rows are read: a refresh costs the same after hours of training as after a minute.
        records = s.metrics.records(last=self.points)
        evaluations = s.metrics.evaluation_records(last=self.points)
        measured = s.metrics.timeline(self.window)
        window = self.window
        while window > 1 and len(measured) > MAX_SPANS:  # a wide pipeline: fewer iterations, the page stays light
            window -= 1
            measured = s.metrics.timeline(window)
        timeline = measured.with_idle()
        path = critical_path(measured)  # one walk for the header and the line on the timeline
        frame = self.widget.show(
            header=self.header(measured, path),
            timeline=gantt_spec(timeline, title=LIVE_TITLE, stages=s.plan.stages, replicas=self.replicas,
                                path=path.spans),
            memory=self.memory_figure(),
            series=series_spec(records, evaluations),
            experts=experts_spec(s.metrics.expert_records(iterations=EXPERT_ITERATIONS)))
        self.refreshes += 1
        return frame

    def draw_timeline(self, timeline: Timeline, title: str | None = None) -> int:
        """Show ``timeline`` (measured or simulated) in the live timeline panel until the next refresh."""
        return self.widget.show(timeline=gantt_spec(timeline, title=title or LIVE_TITLE, stages=self.session.plan.stages,
                                                    replicas=self.replicas))

    def show_timeline(self, timeline: Timeline, title: str = "simulated timeline") -> Any:
        """A simulated (what-if) or saved timeline as a figure of its own, drawn like the live one."""
        return figure(gantt_spec(timeline, title=title, stages=self.session.plan.stages))

    def close(self) -> None:
        self._closed = True
        self._dirty.set()
        self._stop_listening()
        self.widget.close()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)
