"""The live dashboard's widget: one anywidget (front end in extension/src/live/, bundled into static/live.js) that
draws a header line and four plotly panels from whole figures Python sends it (the experts' load only for a
mixture-of-experts model: a panel sent an empty figure stays hidden).

Why not plotly's own ``FigureWidget``: it is an anywidget whose module carries all of plotly.js (5 MB), and anywidget
gives a module 2 s to load and initialize; a model that misses that budget (a busy browser, a busy machine) drops
every later message from Python, and plotly's widget sends its figure as deltas (set, then reset to None) that a
late model never sees. The panels stayed blank. Here the module is small (it initializes in milliseconds), plotly.js
travels once per display as gzipped bytes that the view imports after that window (once per page), and each trait
holds a whole figure, so any view, however late, draws the newest state. One ``show()`` is one message to the
browser; the browser draws only the newest state of each panel (see view.ts).
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import anywidget
import traitlets

STATIC = Path(__file__).parent / "static"
PANELS = ("timeline", "memory", "series", "experts")


@functools.cache
def plotly_bundle() -> tuple[bytes, str]:
    """The gzipped plotly.js ES module the front end draws with, and a key that names its version."""
    data = (STATIC / "plotly.js.gz").read_bytes()
    return data, hashlib.sha256(data).hexdigest()[:16]


def _size(value: Any) -> int:
    """Bytes of ``value`` as JSON, about what its trait's update message carries."""
    return len(json.dumps(value, default=str, separators=(",", ":")))


class LiveView(anywidget.AnyWidget):
    """A header and the timeline, memory, series and experts panels; ``show()`` replaces any of them."""

    _esm = STATIC / "live.js"
    _plotly = traitlets.Bytes().tag(sync=True)
    _plotly_key = traitlets.Unicode().tag(sync=True)
    header = traitlets.Dict({"state": "", "text": ""}).tag(sync=True)
    timeline = traitlets.Dict().tag(sync=True)
    memory = traitlets.Dict().tag(sync=True)
    series = traitlets.Dict().tag(sync=True)
    experts = traitlets.Dict().tag(sync=True)
    frame = traitlets.Int(0).tag(sync=True)
    role = traitlets.Unicode("dashboard").tag(sync=True)  # dashboard | what-if | history (the page tells them apart)

    def __init__(self, **kwargs: Any) -> None:
        data, key = plotly_bundle()
        super().__init__(_plotly=data, _plotly_key=key, **kwargs)
        self._lock = threading.Lock()  # show() is called from the dashboard's refresher thread and from user code
        self.sent_bytes = 0  # JSON bytes of the header and panels show() changed, all told (plotly.js not counted)

    def show(self, *, header: dict[str, Any] | None = None, **panels: dict[str, Any]) -> int:
        """Replace the header and any of the panels (figure dicts) in one message; returns the frame number."""
        unknown = set(panels) - set(PANELS)
        if unknown:
            raise ValueError(f"no panel named {sorted(unknown)}: the panels are {', '.join(PANELS)}")
        with self._lock, self.hold_sync():
            if header is not None:
                self.sent_bytes += _size(header) if header != self.header else 0
                self.header = header
            for name, figure in panels.items():
                # what goes to the browser: only what changed (an equal figure is not sent again)
                self.sent_bytes += _size(figure) if figure != getattr(self, name) else 0
                setattr(self, name, figure)
            self.frame += 1
            return self.frame
