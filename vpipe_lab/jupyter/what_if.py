"""The editor's try-before-applying view: the draft's simulated iteration next to the last measured one (one time
axis, the timeline's colours), each stage's predicted peak memory for the running plan and the draft against a
budget the user sets (a line), and the draft at another shard count (FSDP2 ranks per stage), drawn under the
partition editor (``jupyter/partition_widget.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as widgets

from vpipe_lab.charts.compare import pair_spec, peak_spec, record_spec
from vpipe_lab.core.cost import scaling
from vpipe_lab.core.cost.calibration import Calibration
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import ModelProfile
from vpipe_lab.core.report import human_time
from vpipe_lab.core.timeline import Timeline
from vpipe_lab.jupyter.live_view import LiveView

GIB = 2**30


class WhatIf:
    """A budget box and a LiveView; ``draw`` replaces what it shows (from the editor's thread)."""

    def __init__(self, on_budget: Callable[[int | None], None], on_shards: Callable[[], None] | None = None,
                 shards: int = 1) -> None:
        self.view = LiveView(role="what-if")
        self.budget = widgets.BoundedFloatText(
            value=0.0, min=0.0, max=1e6, step=0.25, description="budget (GiB)",
            tooltip="each stage's memory budget for the what-if and the plan check; 0: what the devices have",
            style={"description_width": "initial"}, layout=widgets.Layout(width="220px"))
        self.budget.observe(lambda change: on_budget(int(change["new"] * GIB) if change["new"] > 0 else None),
                            names="value")
        self.running_shards = shards  # what the job runs; the box below prices the draft on another count
        self.shards = widgets.BoundedIntText(
            value=shards, min=1, max=4096, description="shards (what-if)",
            tooltip="ranks sharding each stage with FSDP2, for the what-if: the global batch split over them, each "
                    "rank's share and collectives priced; the job runs its own count (another runs after a restart)",
            style={"description_width": "initial"}, layout=widgets.Layout(width="200px"))
        if on_shards is not None:
            self.shards.observe(lambda change: on_shards(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.budget, self.shards]), self.view])

    def on_mesh(self, draft: Plan, profile: ModelProfile) -> tuple[Plan, ModelProfile]:
        """The draft on the box's shard count, and the profile at the micro-batch each rank then computes (the
        global batch splits over shards x replicas: ``core/cost/scaling.py``); as they are at the job's own count."""
        shards = int(self.shards.value)
        if shards == draft.shards:
            return draft, profile
        plan = draft.with_mesh(shards=shards)
        batch = profile.microbatch_size * draft.data_parallel
        if profile.microbatch_size and batch % plan.data_parallel == 0:
            profile = scaling.at(profile, batch // plan.data_parallel)
        return plan, profile

    def mesh_problem(self) -> str | None:
        """Why the draft cannot be applied live: the what-if prices another shard count than the job runs."""
        shards, running = int(self.shards.value), self.running_shards
        if shards == running:
            return None
        return (f"the what-if prices {shards} shards per stage, the job runs {running}: another mesh runs after a "
                f"restart (session.save(path), then launch(..., shards={shards}, resume=path)); set the what-if's "
                f"shards back to {running} to apply this draft")

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
        mesh = (f" at {int(self.shards.value)} shards per stage (after a restart)"
                if int(self.shards.value) != self.running_shards else "")
        text = (f"draft{mesh}: {draft_text}; "
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
