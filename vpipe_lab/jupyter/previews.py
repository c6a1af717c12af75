"""The editor's what-if numbers: each plan's estimate and simulated iteration under the profile in hand (computed
once per plan until the profile changes), and the same scaled by the running plan's calibration."""

from __future__ import annotations

import collections
import logging
import math
from typing import Any

from vpipe_lab.core.cost.calibration import Calibration
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.errors import VpipeError
from vpipe_lab.core.interop import torch_grid
from vpipe_lab.core.plan import Estimate, Plan
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.core.timeline import Timeline

log = logging.getLogger(__name__)
KEEP = 64  # plans whose previews are kept under one profile: a long session of drags drops the oldest


def estimate_doc(est: Estimate, iteration_s: float, plan: Plan) -> dict[str, Any]:
    """What the editor's front end reads of one plan: simulated iteration, per-stage times and peaks against the
    budgets, and its schedule grid in torch's action strings (text and CSV)."""
    doc = {"iteration_s": iteration_s, "stage_s": list(est.stage_s), "peak_bytes": list(est.peak_bytes),
           "budget_bytes": list(est.budget_bytes), "feasible": est.feasible}
    try:  # the schedule grid: each rank's actions by time step, in torch's action strings
        steps = torch_grid.grid(plan)
        doc.update(grid=torch_grid.format_grid(steps), grid_csv=torch_grid.grid_csv(steps))
    except VpipeError as exc:  # a schedule torch's strings cannot say (none registered today): no grid
        log.info("no schedule grid for %s: %s", plan.describe(), exc)
    return doc


def calibrated(docs: dict[str, Any], found: Calibration | None) -> dict[str, Any]:
    """Every plan's doc in ``docs`` with its simulated iteration scaled by ``found`` (the raw one kept as
    ``simulated_s``) and the calibration described; ``docs`` unchanged when there is none."""
    if found is None:
        return docs
    out: dict[str, Any] = {"calibration": found.describe()}
    for key, doc in docs.items():
        out[key] = ({**doc, "simulated_s": doc["iteration_s"], "iteration_s": found.apply(doc["iteration_s"])}
                    if isinstance(doc, dict) else doc)
    return out


class Previews:
    """Plans' docs and simulated iterations under one profile and cluster; ``clear`` when either changes."""

    def __init__(self) -> None:
        self._cache: dict[Plan, tuple[dict[str, Any], Timeline]] = {}

    def clear(self) -> None:
        self._cache.clear()

    def doc(self, plan: Plan, profile: ModelProfile, cluster: Cluster) -> dict[str, Any]:
        """The cost model's and the simulator's verdict on ``plan`` (validated by the caller), once per plan."""
        if plan not in self._cache:
            if len(self._cache) >= KEEP:
                self._cache.pop(next(iter(self._cache)))
            timeline = simulate(plan, profile, cluster)
            self._cache[plan] = (estimate_doc(estimate(plan, profile, cluster), timeline.iteration_s, plan), timeline)
        return self._cache[plan][0]

    def timeline(self, plan: Plan | None) -> Timeline | None:
        """``plan``'s simulated iteration, if it was previewed under the profile in hand."""
        found = self._cache.get(plan) if plan is not None else None
        return found[1] if found is not None else None

    def __len__(self) -> int:
        return len(self._cache)


class Shown:
    """The draft what-ifs sent to the page, newest last: which one the user saw as they clicked Apply is the one the
    page names (Python may have sent a newer number, a re-calibration, that had not reached the page yet)."""

    def __init__(self, keep: int = 16) -> None:
        self._sent: collections.deque[tuple[Plan, float]] = collections.deque(maxlen=keep)

    def sent(self, plan: Plan, seconds: float) -> None:
        self._sent.append((plan, seconds))

    @property
    def last(self) -> tuple[Plan, float] | None:
        return self._sent[-1] if self._sent else None

    def seen(self, seconds: float | None) -> tuple[Plan, float] | None:
        """The number the page says it showed, if it is one this editor sent (anything else is not a prediction the
        lab made, so it is not recorded as one); else the last one sent."""
        if seconds is not None:
            for plan, sent in reversed(self._sent):
                if math.isclose(sent, seconds, rel_tol=1e-12):
                    return plan, sent
            log.info("partition editor: the page showed %r s, which it was never sent; recording the last one", seconds)
        return self.last
