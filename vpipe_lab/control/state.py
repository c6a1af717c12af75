"""What the controller knows of a running job: the plan in force, its version, the layers, progress, last changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster


@dataclass
class JobState:
    """Shared by the Session's collaborators; written under the Session's condition (or before any thread runs)."""

    iteration: int = 0  # iterations completed
    target: int | None = 0  # the iteration training runs to (None: until stopped)
    plan: Plan | None = None
    plan_version: int = 0
    names: list[str] = field(default_factory=list)
    units: list[str] | None = None  # what rank 0 reported when it started alone (JobSpec.scout)
    ready: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its READY report
    migrating: int | None = None  # the plan version being moved to (its checkpoint is the fallback)
    last_checkpoint: Path | None = None
    last_migration: dict[str, Any] | None = None
    last_mapping: dict[int, int | None] | None = None

    def adopt(self, ready: list[dict[str, Any]], current: dict[str, Any]) -> None:
        """Take what rank 0 reported (READY bodies, and for an attached job its current state)."""
        for body in ready:
            self.ready[int(body["rank"])] = body
        first = self.ready[0]
        self.plan = Plan.from_dict(current.get("plan") or first["plan"])
        self.names = list(current.get("names") or first["names"])
        self.plan_version = int(current.get("plan_version", self.plan_version))
        self.iteration = int(current.get("iteration", first.get("iteration", self.iteration)))
        self.target = None if current.get("running") else self.iteration

    def cluster(self, stages: int, memory_budget: list[int] | None) -> Cluster:
        """The hardware the ranks reported at start as the planners see it: ``memory_budget`` per stage (or this
        machine's memory split evenly), and the slowest measured host-copy and stage-to-stage bandwidths."""
        ready = [self.ready[r] for r in sorted(self.ready)]
        swap = min(float(b.get("swap_bandwidth", 1e10)) for b in ready)
        link = min(float(b.get("link_bandwidth", 1e10)) for b in ready)
        latency = max(float(b.get("link_latency_s", 0.0)) for b in ready) / 2  # probes time a round trip
        if memory_budget:
            budgets: int | tuple[int, ...] = tuple(memory_budget)
        else:
            import psutil  # only to size a default budget; the controller needs nothing beyond the stdlib + zmq

            budgets = int(psutil.virtual_memory().total // stages)
        return Cluster(stages, budgets, swap, link if link != float("inf") else 1e12, latency, False,
                       f"{stages} x {ready[0].get('device', '?')} (measured)")
