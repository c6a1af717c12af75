"""The session's record in a notebook (``%vpipe history``): every plan that ran, with what it measured and what was
predicted, a Revert button that returns to one of them, and two of them compared side by side (their last measured
iterations on one time scale, where each stage's time went, every plan's measured against predicted time).

The table and the comparison are redrawn when a plan changes and otherwise at most every ``period`` seconds while
training goes on (the medians move); a revert runs in a thread of its own, so the kernel stays free.
"""

from __future__ import annotations

import html
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from vpipe_lab.charts.compare import pair_spec, record_spec, split_spec
from vpipe_lab.core.report import human_time
from vpipe_lab.jupyter.live_view import LiveView

if TYPE_CHECKING:
    from vpipe_lab.control.session import Session

log = logging.getLogger(__name__)
SHOWN = {"entry": "entry", "source": "applied by", "plan": "plan", "from_iteration": "from iteration",
         "iterations": "iterations", "median_s": "median iteration", "samples_per_s": "samples/s",
         "predicted_s": "predicted when applied", "error": "measured vs predicted", "bottleneck": "bottleneck stage"}


def table_html(rows: list[dict[str, Any]]) -> str:
    """The record as an HTML table (times in ms, the error as a signed percentage, the plan in force in bold)."""

    def cell(key: str, value: Any) -> str:
        if value is None or value != value:  # None or NaN
            return "–"
        if key in ("median_s", "predicted_s"):
            return human_time(float(value))
        if key == "error":
            return f"{float(value):+.1%}"
        if key == "samples_per_s":
            return f"{float(value):,.1f}"
        return html.escape(str(value), quote=False)

    head = "".join(f"<th>{label}</th>" for label in SHOWN.values())
    body = "".join(
        "<tr" + (" style='font-weight:bold'" if r["to_iteration"] is None else "") + ">"
        + "".join(f"<td>{cell(k, r.get(k))}</td>" for k in SHOWN) + "</tr>" for r in rows)
    return (f"<table class='vpipe-history'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")


class HistoryPanel:
    """The record of a Session as a widget; display it in a cell (``%vpipe history`` does)."""

    def __init__(self, session: Session, *, period: float = 2.0) -> None:
        self.session, self.period = session, period
        self.table = widgets.HTML()
        layout = widgets.Layout(width="auto")
        self.pick = widgets.Dropdown(description="entry", layout=layout)
        self.revert_button = widgets.Button(description="Revert", tooltip="run this entry's plan again from the next "
                                                                          "iteration (layers migrate live)")
        self.a = widgets.Dropdown(description="compare", layout=layout)
        self.b = widgets.Dropdown(description="with", layout=layout)
        self.compare_button = widgets.Button(description="Compare")
        self.status = widgets.HTML()
        self.view = LiveView(role="history")
        self.widget = widgets.VBox([self.table, widgets.HBox([self.pick, self.revert_button]),
                                    widgets.HBox([self.a, self.b, self.compare_button]), self.status, self.view])
        self.revert_button.on_click(lambda _: self._revert())
        self.compare_button.on_click(lambda _: self._compare_chosen())
        self._lock = threading.Lock()
        self._last = 0.0
        self._closed = False
        self._chosen: tuple[int, int] | None = None  # what the user asked to compare (else the newest two)
        self._unsubscribe = session.on_event(self._on_event)
        self.refresh()

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "plan" or (kind == "iteration" and time.monotonic() - self._last >= self.period):
            try:
                self.refresh()
            except Exception:  # the widget may be closed meanwhile; the next event tries again
                log.debug("history refresh failed", exc_info=True)
        elif kind in ("closed", "failed"):
            self._unsubscribe()

    def refresh(self) -> None:
        """Redraw the table, the choices and the comparison from the session's record."""
        with self._lock:
            if self._closed:
                return
            self._last = time.monotonic()
            rows = self.session.record.rows()
            self.table.value = table_html(rows)
            options = [(f"{r['entry']}: {r['source']}, {r['plan']}", r["entry"]) for r in rows]
            for dropdown in (self.pick, self.a, self.b):
                keep = dropdown.value
                dropdown.options = options
                if keep in [v for _, v in options]:
                    dropdown.value = keep
            if rows and self.pick.value is None:
                self.pick.value = rows[0]["entry"]
            if len(rows) >= 2 and self._chosen is None:
                self.a.value, self.b.value = rows[-2]["entry"], rows[-1]["entry"]
            self._draw(rows)

    def _draw(self, rows: list[dict[str, Any]]) -> None:
        if len(rows) < 2 or self.a.value is None or self.b.value is None:
            self.view.show(header={"state": self.session.status, "text": "one plan so far: apply a change to compare two"},
                           series=record_spec(rows))
            return
        a, b = int(self.a.value), int(self.b.value)
        (split_a, last_a), (split_b, last_b) = self.session.record.entry_split(a), self.session.record.entry_split(b)
        labels = (f"entry {a}", f"entry {b}")
        by = {r["entry"]: r for r in rows}
        text = "; ".join(f"entry {n} ({by[n]['source']}): {by[n]['plan']}, median "
                         f"{human_time(by[n]['median_s']) if by[n]['median_s'] else '–'}" for n in (a, b))
        self.view.show(header={"state": self.session.status, "text": text}, timeline=pair_spec(last_a, last_b, labels),
                       memory=split_spec(split_a or [], split_b or [], labels), series=record_spec(rows))

    def _compare_chosen(self) -> None:
        self._chosen = (self.a.value, self.b.value)
        self.refresh()

    def _revert(self) -> None:
        entry = self.pick.value
        if entry is None:
            return
        self.status.value = f"reverting to entry {entry} ..."

        def run() -> None:
            try:
                done = self.session.revert(int(entry))
                self.status.value = html.escape(f"entry {entry}'s plan in force from iteration {done.iteration} "
                                                f"({done.moves} layer(s) moved)", quote=False)
            except Exception as exc:  # shown where the user clicked; nothing changed
                why = html.escape(f"{type(exc).__name__}: {exc}", quote=False)
                self.status.value = f"<span style='color:#c0392b'>{why}</span>"
            self.refresh()

        threading.Thread(target=run, name="vpipe-revert", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._unsubscribe()
        self.widget.close()
        self.view.close()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)
