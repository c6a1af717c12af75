"""Each worker's memory predicted beside measured, for a running Session (its collaborator ``MemoryTable``).

The prediction is the cost model's peak for the plan in force over the newest measured profile (weights, gradients,
optimizer state, activations kept, swapped or recomputed, working sets), as the planner decides by it before launch.
The measurement is independent of it: ``allocated_peak`` is what the allocator really held at its most
(``runtime/engine/allocator.py``: torch.profiler's memory events on CPU, ``max_memory_allocated`` on CUDA), beside the
ledger's count (``counted_peak``: static bytes plus the saved tensors counted, the very basis the profile feeds the
prediction, so it cannot catch temporaries or what the count misses). On a CPU a swapped layer's host copy lives in
the memory the allocator counts, so there the prediction adds its host bytes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from vpipe_lab.core.cost.costmodel import estimate

if TYPE_CHECKING:
    from vpipe_lab.control.changes.profiles import Profiles
    from vpipe_lab.core.plan import Plan
    from vpipe_lab.core.profile import Cluster, ModelProfile
    from vpipe_lab.telemetry.metrics import Metrics


class Placed(Protocol):
    """Where the workers run (the session's ``processes``)."""

    @property
    def device(self) -> str:
        """What rank 0 runs on ("cpu", "cuda:0", ...)."""


class MemoryHost(Protocol):
    """What the table reads of the session it describes (``control/session.py``'s ``Session``)."""

    metrics: Metrics

    @property
    def processes(self) -> Placed:
        """The worker processes."""

    @property
    def plan(self) -> Plan:
        """The plan in force."""

    def newest_profile(self) -> ModelProfile:
        """The newest measured profile, asking the workers for one if none was measured."""

    def profile(self) -> ModelProfile:
        """A profile measured now (the workers asked)."""

    @property
    def closed(self) -> bool:
        """The workers are gone: nothing can be asked of them."""

    def cluster(self) -> Cluster:
        """The running hardware as the planners see it."""


class MemoryTable:
    """``Session.memory()``: a row per worker, the cost model's peak for the plan in force beside the allocator's."""

    def __init__(self, session: MemoryHost, profiles: Profiles) -> None:
        self.session, self.profiles = session, profiles
        self._profiled_after = -1  # the newest allocator measurement the profile in hand has seen

    def frame(self, ask: bool = True) -> Any:
        """The table ``Session.memory`` documents; ``ask=False`` asks the workers for nothing."""
        import pandas as pd

        session = self.session
        plan, cluster = session.plan, session.cluster()
        rows_now = {(r["stage"], r.get("replica", 0)): r for r in session.metrics.latest_memory()}
        measured = max((int(r.get("allocated_at") or -1) for r in rows_now.values()), default=-1)
        if ask and measured > self._profiled_after and not session.closed:
            # the workers measured the allocator since the profile in hand (a change remeasures it): the layers'
            # working sets they noted then (engine/allocator.py) belong to the plan in force, so ask for them
            profile: ModelProfile | None = session.profile()
            self._profiled_after = measured
        else:
            profile = session.newest_profile() if ask else self.profiles.newest
        # the workers: each stage's ranks by (shard, replica); a worker reports as its data-parallel pipeline
        workers = [(s, dp % plan.shards, dp // plan.shards, dp) for s in range(plan.stages)
                   for dp in range(plan.data_parallel)]
        if profile is None:
            return pd.DataFrame([{"stage": s, "shard": k, "replica": r, "predicted_peak": None}
                                 for s, k, r, _ in workers])
        est = estimate(plan, profile, dataclasses.replace(cluster, stages=plan.stages))
        on_cpu = session.processes.device == "cpu"
        rows = []
        for s, shard, replica, dp in workers:
            predicted = est.peak_bytes[s] + (est.host_bytes[s] if on_cpu and est.host_bytes else 0)
            now = rows_now.get((s, dp), {})
            allocated = now.get("allocated_peak")
            rows.append({
                "stage": s, "shard": shard, "replica": replica, "predicted_peak": predicted,
                "allocated_peak": allocated,
                "allocated_at": now.get("allocated_at"),
                "error": allocated / predicted - 1 if allocated and predicted else None,
                "counted_peak": now.get("peak"), "static": est.static_bytes[s] if est.static_bytes else None,
                "activations": est.activation_bytes[s] if est.activation_bytes else None,
                "budget": est.budget_bytes[s],  # the job's memory_budget, else the planners' share of the machine
            })
        return pd.DataFrame(rows)
