"""Each stage's memory predicted beside measured, for a running Session (mixed into ``control/session.py``).

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
from collections.abc import Callable
from typing import Any

from vpipe_lab.core.cost.costmodel import estimate


class MemoryView:
    """``Session.memory()``: the Session owns the state named below."""

    plan: Any
    metrics: Any
    processes: Any
    _profiles: Any
    newest_profile: Callable[[], Any]  # the Session's own (attributes, not stub methods a mixin order could let win)
    cluster: Callable[[], Any]

    def memory(self, ask: bool = True) -> Any:
        """A DataFrame with a row per worker (``stage``, ``shard``, ``replica``; a pipeline of whole devices has one
        per stage): ``predicted_peak`` (the cost model's for that rank, for the plan in force), ``allocated_peak``
        (what the allocator held, newest measurement; ``allocated_at`` its iteration), ``error`` (allocated over
        predicted, minus 1), ``counted_peak`` (the ledger's count), ``static`` and ``activations`` as predicted, and
        the ``budget``. Measured columns are empty until the workers have measured. ``ask=False`` asks the workers
        for nothing: the prediction uses the profile in hand, and is None before one was measured."""
        import pandas as pd

        plan, cluster = self.plan, self.cluster()
        profile = self.newest_profile() if ask else self._profiles.newest
        # the workers: each stage's ranks by (shard, replica); a worker reports as its data-parallel pipeline
        workers = [(s, dp % plan.shards, dp // plan.shards, dp) for s in range(plan.stages)
                   for dp in range(plan.data_parallel)]
        if profile is None:
            return pd.DataFrame([{"stage": s, "shard": k, "replica": r, "predicted_peak": None}
                                 for s, k, r, _ in workers])
        est = estimate(plan, profile, dataclasses.replace(cluster, stages=plan.stages))
        on_cpu = self.processes.device == "cpu"
        rows_now = {(r["stage"], r.get("replica", 0)): r for r in self.metrics.latest_memory()}
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
