"""vPipe's online replanning on its own: when to replan, and whether a new plan is worth its migration.

Replans every ``every`` iterations, and sooner when a stage's measured busy time drifts from what the plan in force
predicted, or when a stage's memory headroom runs low. A new plan is applied only when its predicted gain over the
next ``horizon`` iterations outweighs its migration cost (and beats noise, ``min_gain``). Every decision is kept in
``decisions`` and streamed as a "replan" event.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vpipe_lab.core import documents
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster
from vpipe_lab.core.timeline import COMPUTE_KINDS

log = logging.getLogger(__name__)


@dataclass
class Decision:
    iteration: int
    reason: str
    current_s: float
    predicted_s: float
    migration_s: float
    moves: int
    applied_at: int | None
    note: str = ""


class Replannable(Protocol):
    """What the auto-replanner needs of a session (``Session`` is one)."""

    @property
    def plan(self) -> Plan: ...

    def on_event(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]: ...

    def replan(self, method: str = ...) -> Any: ...

    def apply(self, plan: Plan, *, source: str = ...) -> int: ...

    def cluster(self) -> Cluster: ...


class AutoReplanner:
    def __init__(self, session: Replannable, *, publish: Callable[[dict[str, Any]], None] | None = None,
                 every: int = 20, drift: float = 0.15, headroom: float = 0.05,
                 horizon: int = 100, min_gain: float = 0.02, method: str = "vpipe", warmup: int = 2) -> None:
        if every < 1 or horizon < 1 or not 0 <= drift or not 0 <= headroom < 1:
            raise ValueError(f"auto_replan needs every >= 1, horizon >= 1, drift >= 0 and 0 <= headroom < 1; got "
                             f"every={every}, horizon={horizon}, drift={drift}, headroom={headroom}")
        self.session = session
        self.publish = publish  # where decisions go as "replan" events (the session's event queue)
        self.every, self.drift, self.headroom = every, drift, headroom
        self.horizon, self.min_gain, self.method, self.warmup = horizon, min_gain, method, warmup
        self.decisions: list[Decision] = []
        self._last = -1  # iteration of the last replan
        self._predicted: tuple[float, ...] | None = None  # per-stage time per micro-batch of the plan in force
        self._busy = threading.Lock()
        self._stop = False
        self._unsubscribe = session.on_event(self._on_event)

    def stop(self) -> None:
        self._stop = True
        self._unsubscribe()

    def _on_event(self, event: dict[str, Any]) -> None:
        if self._stop or event.get("type") != "iteration":
            return
        it = int(event["iteration"])
        if it < self.warmup:
            return
        reason = self._trigger(event, it)
        if reason and self._busy.acquire(blocking=False):
            # Replanning talks to the workers and waits for them: never on the thread that delivers events.
            threading.Thread(target=self._replan, args=(it, reason), name="vpipe-autoplan", daemon=True).start()

    def _trigger(self, event: dict[str, Any], it: int) -> str:
        if self._last < 0 or it - self._last >= self.every:
            return "periodic"
        spans = event.get("spans") or []
        m = event.get("microbatches") or 1
        if self._predicted and spans:
            for stage, predicted in enumerate(self._predicted):
                busy = sum(s.duration_s for s in spans if s.stage == stage
                           and s.kind in COMPUTE_KINDS) / m
                if predicted > 0 and abs(busy - predicted) / predicted > self.drift:
                    return f"stage {stage} runs {busy / predicted - 1:+.0%} off its prediction"
        for row in event.get("memory") or []:
            budget = row.get("budget")
            if budget and row.get("peak", 0) > (1 - self.headroom) * budget:
                return f"stage {row['stage']} has under {self.headroom:.0%} memory headroom"
        return ""

    def _replan(self, it: int, reason: str) -> None:
        s = self.session
        try:
            found = s.replan(self.method)
            self._last = it
            cost = found.migration_s
            worth = found.gain > self.min_gain and found.gain_s * self.horizon > cost and found.plan != s.plan
            applied = s.apply(found.plan, source="auto") if worth else None
            note = "applied" if worth else (
                "no better plan" if found.gain <= self.min_gain else "gain does not pay for the migration")
            decision = Decision(it, reason, found.current_s, found.predicted_s, cost, len(found.moves), applied, note)
            self._predicted = estimate(s.plan, found.profile, s.cluster()).stage_s if found.profile else None
        except Exception as exc:  # the session may have stopped or failed meanwhile; report, do not crash
            decision = Decision(it, reason, float("nan"), float("nan"), float("nan"), 0, None, f"failed: {exc}")
            log.warning("automatic replanning failed: %s", exc)
        finally:
            self._busy.release()
        self.decisions.append(decision)
        log.info("auto replan at iteration %d (%s): %s", it, reason, decision.note)
        if self.publish is not None:
            self.publish({"type": "replan", **documents.dump(decision)})
