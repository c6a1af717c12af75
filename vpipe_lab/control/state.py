"""What the controller knows of a running job: the plan in force, its version, the layers, progress, last changes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.core.change import Applied
from vpipe_lab.core.interop.bundle import UnitInfo
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster
from vpipe_lab.wire.events import Current, Ready


def infos(docs: list[dict[str, Any]] | None, names: list[str]) -> list[UnitInfo]:
    """The units' descriptions as the workers sent them (names alone from workers that send none)."""
    if docs and len(docs) == len(names):
        return [UnitInfo.from_dict(d, f"unit {i}") for i, d in enumerate(docs)]
    return [UnitInfo(n) for n in names]


@dataclass
class JobState:
    """Shared by the Session's collaborators; written under the Session's condition (or before any thread runs)."""

    iteration: int = 0  # iterations completed
    target: int | None = 0  # the iteration training runs to (None: until stopped)
    paused: bool = False  # by pause(), or by an over-budget iteration, until resume() or run()
    plan: Plan | None = None
    plan_version: int = 0
    names: list[str] = field(default_factory=list)
    unit_info: list[UnitInfo] = field(default_factory=list)  # each unit's modules and kind (the export's names)
    units: list[str] | None = None  # what rank 0 reported when it started alone (JobSpec.scout)
    refused: str | None = None  # or why the job cannot run (a batch its data-parallel ranks cannot share)
    ready: dict[int, Ready] = field(default_factory=dict)  # rank -> its READY report
    migrating: int | None = None  # the plan version being moved to (its checkpoint is the fallback)
    last_checkpoint: Path | None = None
    applied: list[Applied] = field(default_factory=list)  # every live change in force so far, oldest first
    first: Applied | None = None  # the plan in force when the session began (launched or attached), as a record
    last_migration: dict[str, Any] | None = None  # the newest of ``applied`` as a dict (what events carry)
    last_mapping: dict[int, int | None] | None = None

    def unreachable(self, goal: int, paused: bool) -> str | None:
        """Why ``goal`` iterations will not be done as things stand (None: they are, or may be)."""
        if self.iteration >= goal:
            return None
        if paused:
            return f"the session is paused at iteration {self.iteration}: resume() it (or run()) first"
        if self.target is not None and self.target < goal and self.iteration >= self.target:
            return (f"training stopped at iteration {self.target} (the target of the last run()) and was not asked "
                    f"for more: run({goal - self.iteration}) first")
        return None

    def adopt(self, ready: list[Ready], current: Current | None) -> None:
        """Take what the ranks reported at start (READY), and for an attached job its current state."""
        for body in ready:
            self.ready[body.rank] = body
        first = self.ready[0]
        if current is None:
            self.plan, self.names, self.iteration = Plan.from_dict(first.plan), list(first.names), first.iteration
            self.unit_info = infos(first.units, self.names)
            self.target = self.iteration
            self.first = Applied(self.plan, self.plan_version, self.iteration, source="launch")
            return
        self.plan, self.names = Plan.from_dict(current.plan), list(current.names)
        self.unit_info = infos(current.units, self.names)
        self.plan_version, self.iteration = current.plan_version, current.iteration
        self.first = Applied(self.plan, self.plan_version, self.iteration, source="attach")
        self.target = None if current.running else self.iteration
        self.paused = current.paused

    def cluster(self, stages: int, memory_budget: Sequence[int] | None, step_overhead_s: float = 0.0,
                iteration_overhead_s: float = 0.0) -> Cluster:
        """The hardware the ranks reported at start as the planners see it: ``memory_budget`` per stage (or this
        machine's memory split evenly), the slowest measured host-copy and stage-to-stage bandwidths, and the
        runtime's measured time per compute step; swaps overlap compute only on GPUs; the slowest optimizer step and
        weight copy per byte (what PipeDream's updates cost); the measured time between iterations."""
        ready = [self.ready[r] for r in sorted(self.ready)]
        swap = min(b.swap_bandwidth for b in ready)
        link = min(b.link_bandwidth for b in ready)
        latency = max(b.link_latency_s for b in ready) / 2  # probes time a round trip
        if memory_budget:
            budgets: int | tuple[int, ...] = tuple(memory_budget)
        else:
            import psutil  # only to size a default budget; the controller needs nothing beyond the stdlib + zmq

            budgets = int(psutil.virtual_memory().total // stages)
        # CPU ranks copy swapped activations on their compute thread (runtime/memory/swap.py): nothing hides them
        overlaps = all(b.device.startswith("cuda") for b in ready)
        sharded = [b.shard_bandwidth for b in ready if b.shard_bandwidth > 0]  # the slowest stage's shards
        return Cluster(stages, budgets, swap, link if link != float("inf") else 1e12, latency, False,
                       f"{stages} x {ready[0].device} (measured)", step_overhead_s, overlaps,
                       max(b.update_s_per_byte for b in ready), max(b.copy_s_per_byte for b in ready),
                       iteration_overhead_s, min(sharded) if sharded else 0.0)
