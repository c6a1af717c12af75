"""The schedules vpipe_lab runs, built in the IR of ``core/schedules/actions.py`` by their kinds (``core/schedules/``):
``for_plan`` gives a plan's; the named builders are each kind's ``build`` for callers that know which they want."""

from __future__ import annotations

from typing import Protocol

from vpipe_lab.core import schedules
from vpipe_lab.core.schedules.actions import Schedule
from vpipe_lab.core.schedules.plan_view import PlanView as Plan


class Planned(Plan, Protocol):
    """A plan as ``for_plan`` reads it: what the schedules read, and which schedule for how many stages and
    micro-batches (``core.plan.Plan``; the schedules never import it)."""

    @property
    def schedule(self) -> str: ...

    @property
    def stages(self) -> int: ...

    @property
    def microbatches(self) -> int: ...


def gpipe(stages: int, microbatches: int, plan: Plan | None = None) -> Schedule:
    """GPipe with a flush: every forward, then every backward, in micro-batch order."""
    return schedules.get("gpipe").build(stages, microbatches, plan, 1)


def one_f_one_b(stages: int, microbatches: int, plan: Plan | None = None, *, eager: bool = False) -> Schedule:
    """1F1B with a flush (PipeDream-Flush); ``eager``: one more warm-up forward on every stage but the last."""
    return schedules.get("eager-1f1b" if eager else "1f1b").build(stages, microbatches, plan, 1)


def zb_h1(stages: int, microbatches: int, plan: Plan | None = None) -> Schedule:
    """ZB-H1: the backward split into B and W, the W steps placed into what would be bubbles."""
    return schedules.get("zb-h1").build(stages, microbatches, plan, 1)


def interleaved_1f1b(stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> Schedule:
    """Interleaved 1F1B: ``virtual`` chunks per stage in looped placement."""
    return schedules.get("interleaved-1f1b").build(stages, microbatches, plan, virtual)


def zbv_schedule(stages: int, microbatches: int, plan: Plan | None = None) -> Schedule:
    """ZBV: two chunks per stage in V placement, backward split into B and W."""
    return schedules.get("zbv").build(stages, microbatches, plan, 2)


def for_plan(plan: Planned) -> Schedule:
    """The schedule a plan runs: its kind, stages and micro-batches, with its swaps and recomputes."""
    return schedules.get(plan.schedule).build(plan.stages, plan.microbatches, plan)
