"""The editor's try-before-applying view: the draft's simulated iteration next to the last measured one (one time
axis, the timeline's colours), each stage's predicted peak memory for the running plan and the draft against a
budget the user sets (a line), drawn under the partition editor (``jupyter/partition_widget.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as widgets

from vpipe_lab.charts.compare import pair_spec, peak_spec, record_spec
from vpipe_lab.core.cost.calibration import Calibration
from vpipe_lab.core.report import human_time
from vpipe_lab.core.timeline import Timeline
from vpipe_lab.jupyter.live_view import LiveView

GIB = 2**30


class WhatIf:
    """A budget box and a LiveView; ``draw`` replaces what it shows (from the editor's thread)."""

    def __init__(self, on_budget: Callable[[int | None], None]) -> None:
        self.view = LiveView(role="what-if")
        self.budget = widgets.BoundedFloatText(
            value=0.0, min=0.0, max=1e6, step=0.25, description="budget (GiB)",
            tooltip="each stage's memory budget for the what-if and the plan check; 0: what the devices have",
            style={"description_width": "initial"}, layout=widgets.Layout(width="220px"))
        self.budget.observe(lambda change: on_budget(int(change["new"] * GIB) if change["new"] > 0 else None),
                            names="value")
        self.widget = widgets.VBox([self.budget, self.view])

    def draw(self, measured: Timeline | None, running: Timeline, draft: Timeline | None,
             peaks: tuple[Sequence[float], Sequence[float] | None], budgets: Sequence[int | None],
             record: Sequence[Mapping[str, Any]] = (), calibration: Calibration | None = None) -> None:
        """The last measured iteration (else the running plan simulated) above the draft simulated, the peaks, and
        the session's record (each plan's measured against predicted time: how far to trust the what-if). With
        ``calibration`` (``core/cost/calibration.py``) the simulated iterations are drawn calibrated, on the measured
        one's scale, and the header gives the draft's calibrated time, the editor's what-if, beside its plain
        simulation."""
        seen = measured is not None and len(measured) > 0
        factor = calibration.factor if calibration is not None else 1.0
        left = measured if seen and measured is not None else running.scaled(factor)
        shown = (draft if draft is not None else running).scaled(factor)
        simulated = "simulated" if calibration is None else f"simulated x{factor:.3f}"
        lane = "simulated" if calibration is None else "calibrated"  # a lane's label, short: the margin holds 28 chars
        first = "measured" if seen else f"running ({lane})"
        draft_text = (f"{human_time(shown.iteration_s)} per iteration (simulated {human_time(shown.iteration_s / factor)}"
                      f", calibrated x{factor:.3f} by the running plan's iterations)" if calibration is not None
                      else f"{human_time(shown.iteration_s)} per iteration (simulated)")
        text = (f"draft: {draft_text}; "
                f"{'last measured' if seen else f'running plan ({simulated})'}: {human_time(left.iteration_s)}")
        self.view.show(header={"state": "what-if", "text": text},
                       timeline=pair_spec(left, shown, (first, f"draft ({lane})"),
                                          f"the {'last measured' if seen else 'running plan'} iteration above the "
                                          f"draft's {'calibrated ' if calibration is not None else ''}simulated one, "
                                          "on one time axis"),
                       memory=peak_spec(peaks[0], peaks[1], budgets), series=record_spec(record))

    def close(self) -> None:
        self.view.close()
        self.widget.close()
