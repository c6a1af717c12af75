"""The editor's try-before-applying view (jupyter/what_if.py): the draft's simulated iteration under the running one
on one axis, both plans' peaks against the user's budget, and a header that gives the calibrated what-if."""

from __future__ import annotations

import pytest

from vpipe_lab.core.cost.calibration import Calibration
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster
from vpipe_lab.core.report import human_time
from vpipe_lab.core.workloads import random_chain
from vpipe_lab.jupyter.what_if import GIB, WhatIf


def test_draws_the_draft_under_the_running_plan_and_says_how_it_was_calibrated() -> None:
    profile, cluster = random_chain(8, seed=4), Cluster(2, 10**12, 1e9, 1e9)
    running = simulate(Plan.from_counts([4, 4], 4), profile, cluster)
    draft = simulate(Plan.from_counts([3, 5], 4), profile, cluster)
    budgets: list[int | None] = []
    view = WhatIf(lambda b: budgets.append(b))
    try:
        view.draw(None, running, draft, ([1e9, 1e9], [2e9, 0.5e9]), [4 * GIB, 4 * GIB])
        header = view.view.header["text"]
        assert header == (f"draft: {human_time(draft.iteration_s)} per iteration (simulated); running plan "
                          f"(simulated): {human_time(running.iteration_s)}")
        ticks = view.view.timeline["layout"]["yaxis"]["ticktext"]
        assert "running (simulated) · stage 0" in ticks and "draft (simulated) · stage 1" in ticks
        calibration = Calibration(0.9 * running.iteration_s, running.iteration_s, 20)  # measured at 0.9x the simulation
        view.draw(None, running, draft, ([1e9, 1e9], [2e9, 0.5e9]), [4 * GIB, 4 * GIB], calibration=calibration)
        header = view.view.header["text"]
        assert header.startswith(f"draft: {human_time(draft.iteration_s * 0.9)} per iteration (simulated "
                                 f"{human_time(draft.iteration_s)}, calibrated x0.900")
        # Drawn calibrated too: on the scale the measured iteration would have, and labelled so.
        fig = view.view.timeline
        ends = [x for trace in fig["data"] for x in trace["x"] if x is not None]
        assert max(ends) == pytest.approx(1e3 * 0.9 * max(running.iteration_s, draft.iteration_s))
        ticks = fig["layout"]["yaxis"]["ticktext"]
        assert "running (calibrated) · stage 0" in ticks and "draft (calibrated) · stage 1" in ticks
        view.budget.value = 2.0  # the user's budget box, in GiB, goes to the editor in bytes; 0 gives it back
        view.budget.value = 0.0
        assert budgets == [2 * GIB, None]
    finally:
        view.close()
