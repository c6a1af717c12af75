"""The planning methods by name: what each one partitions by, which policies it may choose and which schedule it plans,
as attributes the planner reads (``planner.py``), so a method is one entry here and not a branch in several places."""

from __future__ import annotations

from dataclasses import dataclass

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.policy import Policy


@dataclass(frozen=True)
class Method:
    """One planning method."""

    name: str
    summary: str
    partition: str  # "uniform" (equal layer counts), "balanced" (by compute), "bottleneck" (PipeDream's), "vpipe"
    policy: Policy | None = None  # every layer's policy when the method fixes it (None: chosen per layer)
    schedule: str | None = None  # the schedule it always plans (PipeDream: its own, with weight stashing)
    exact: bool = False  # after vPipe's search, the exact search seeded with it (may prove the optimum)
    refuses_overflow: bool = False  # a fixed plan that does not fit is refused, not returned with its overflow
    swaps: bool = True  # it may swap or recompute to fit, so a refusal suggests the policies it did not use


BUILT_IN = (
    Method("uniform", "equal layer counts, every activation kept", "uniform", Policy.KEEP),
    Method("balanced", "stages balanced by compute (torchgpipe), every activation kept", "balanced", Policy.KEEP),
    Method("gpipe", "GPipe: equal layer counts, every activation recomputed", "uniform", Policy.RECOMPUTE,
           refuses_overflow=True),
    Method("pipedream", "PipeDream: its min-bottleneck partition and schedule (weight stashing), every activation "
           "kept", "bottleneck", Policy.KEEP, schedule="pipedream", swaps=False),
    Method("pipedream-flush", "PipeDream's partition on the schedule given, every activation kept", "bottleneck",
           Policy.KEEP, swaps=False),
    Method("vpipe", "vPipe: partition and per-layer keep/swap/recompute searched together", "vpipe"),
    Method("optimal", "vPipe's plan as the bound of an exact search", "vpipe", exact=True),
)
_METHODS = {m.name: m for m in BUILT_IN}
METHODS = tuple(_METHODS)


def get(name: str) -> Method:
    """The method called ``name``; PlanError naming the known ones otherwise."""
    try:
        return _METHODS[name]
    except (KeyError, TypeError):
        raise PlanError(f"unknown planning method {name!r}: use one of {', '.join(METHODS)}") from None
