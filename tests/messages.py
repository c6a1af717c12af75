"""Typed message bodies with test defaults, so a test names only the fields it is about."""

from __future__ import annotations

from typing import Any

from vpipe_lab.core.plan import Plan
from vpipe_lab.wire.events import IterationReport, Ready

PLAN = Plan((0, 1, 2), "kk", 2).to_dict()


def ready(rank: int, **fields: Any) -> Ready:
    doc: dict[str, Any] = {"rank": rank, "stage": rank, "replica": 0, "layers": 2, "names": ["a", "b"],
                           "plan": PLAN, "device": "cpu", "backend": "gloo", "iteration": 0,
                           "swap_bandwidth": 1e10, "link_bandwidth": 1e10, "link_latency_s": 0.0}
    return Ready.from_dict({**doc, **fields})


def report(iteration: int, stage: int, **fields: Any) -> IterationReport:
    doc: dict[str, Any] = {"iteration": iteration, "stage": stage, "start": 0.0, "end": 1.0, "losses": [],
                           "memory": {}, "spans": [], "microbatches": 2}
    return IterationReport.from_dict({**doc, **fields})
