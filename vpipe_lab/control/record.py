"""The Session's record of plans as the user reads it (``session.record``): ``history``, ``revert(N)``,
``compare(A, B)``, each entry's split and the calibration the what-if scales by (the record itself is
``control/history.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vpipe_lab.control.history import History
from vpipe_lab.core.change import Applied, Change
from vpipe_lab.core.cost import calibration
from vpipe_lab.core.cost.breakdown import StageTime
from vpipe_lab.core.cost.calibration import Calibration
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.timeline import Timeline


class Record:
    """History, revert and compare (``session.record``; the Session answers ``history``, ``revert`` and ``compare``
    itself too). A revert is a live change, made by the Session's ``change``."""

    def __init__(self, history: History, change: Callable[..., Applied], stages: Callable[[], int]) -> None:
        self._history, self._change, self._stages = history, change, stages

    @property
    def history(self) -> Any:
        """Every plan that ran, a row each (a DataFrame): ``entry`` (what ``revert`` and ``compare`` take), plan version,
        who applied it (``launch``, ``editor``, ``magic``, ``api``, ``planner``, ``auto``, ``revert``, ``restart``), the
        plan, the iterations it ran (``from_iteration`` up to ``to_iteration``), their median time and throughput, the
        simulator's prediction when it was applied (the editor's what-if) and the measured time's ``error`` against
        it, its bottleneck stage, the layers it moved and the pause it took."""
        return self._history.frame()

    def revert(self, entry: int, *, force: bool = False, timeout: float | None = None) -> Applied:
        """Run entry ``entry``'s plan of the ``history`` again from the next iteration boundary (layers migrate
        live); it is recorded as a new entry of source ``revert``."""
        plan, stages = self._history.entry(entry).applied.plan, self._stages()
        if plan.stages != stages:
            raise PlanError(f"entry {entry} ran on {plan.stages} stages and the pipeline has {stages} now (a stage "
                            f"could not come back): apply a plan for {stages} stages; nothing changed")
        return self._change(Change.to(plan, "revert"), force=force, timeout=timeout)

    def compare(self, a: int, b: int) -> Any:
        """Entries ``a`` and ``b`` of the ``history`` side by side, a row per stage: where each one's iteration went
        (compute, recompute, swap, transfer, bubble: seconds and shares, measured over its last iterations), its
        bottleneck and its median iteration time; columns suffixed ``_a`` and ``_b`` by entry number."""
        return self._history.compare(a, b)

    def rows(self) -> list[dict[str, Any]]:
        """``history`` as a list of dicts (what the history panel draws)."""
        return self._history.rows()

    def entry_split(self, entry: int) -> tuple[list[StageTime] | None, Timeline | None]:
        """Where entry ``entry``'s iterations went per stage (its last ones) and its last measured iteration's spans,
        None where none was kept (to draw two entries side by side)."""
        return self._history.split(self._history.entry(entry))

    def calibration(self, simulated_s: float) -> Calibration | None:
        """How the plan in force's recent iterations (their steady pace, ``calibration.steady``, over its last
        ``WINDOW_S`` seconds, at least its newest ``RECENT``, its first ``SETTLE`` after it came into force left out)
        compare with ``simulated_s``, its simulated iteration under the profile in hand: the factor the what-if
        scales a draft's simulation by; None before enough iterations."""
        recent = self._history.recent(calibration.MOST, calibration.SETTLE)
        return calibration.calibrate(calibration.window(recent), simulated_s)
