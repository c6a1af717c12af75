"""The schedule registry: every schedule by name. Adding one is a module of its own and one line in ``BUILT_IN``."""

from __future__ import annotations

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.schedules.dualpipev import DualPipeV
from vpipe_lab.core.schedules.gpipe import GPipe
from vpipe_lab.core.schedules.interleaved_1f1b import Interleaved1F1B
from vpipe_lab.core.schedules.kind import ScheduleKind
from vpipe_lab.core.schedules.one_f_one_b import EagerOneFOneB, OneFOneB
from vpipe_lab.core.schedules.pipedream import PipeDream
from vpipe_lab.core.schedules.zb_h1 import ZBH1
from vpipe_lab.core.schedules.zbv import ZBV

# The registry lines, in the order users see them listed.
BUILT_IN: tuple[ScheduleKind, ...] = (GPipe(), OneFOneB(), EagerOneFOneB(), ZBH1(), Interleaved1F1B(), ZBV(),
                                      DualPipeV(), PipeDream())
_KINDS: dict[str, ScheduleKind] = {k.name: k for k in BUILT_IN}


def register(kind: ScheduleKind) -> ScheduleKind:
    """Make ``kind`` a schedule every part of the lab knows by its name (planners, launch, live changes, the
    command line, the editor); a session's workers get the kinds registered in its process. Returns ``kind``."""
    if not isinstance(kind, ScheduleKind):
        raise PlanError(f"register() takes a ScheduleKind instance, not {type(kind).__name__}: subclass "
                        "vpipe_lab.core.schedules.ScheduleKind, set its name and write its orders()")
    name = getattr(kind, "name", None)
    if not isinstance(name, str) or not name or name != name.strip() or name == "auto":
        raise PlanError(f"a schedule needs a name (a non-empty string, not 'auto'), not {name!r}")
    taken = _KINDS.get(name)
    if taken is not None and type(taken) is not type(kind):
        raise PlanError(f"schedule {name!r} is taken by {type(taken).__name__}: give {type(kind).__name__} another name")
    _KINDS[name] = kind
    return kind


def unregister(name: str) -> None:
    """Forget a registered schedule (never a built-in one)."""
    if any(k.name == name for k in BUILT_IN):
        raise PlanError(f"schedule {name!r} is built in and cannot be unregistered")
    _KINDS.pop(name, None)


def get(name: str) -> ScheduleKind:
    """The schedule called ``name``; PlanError naming the known ones otherwise."""
    try:
        return _KINDS[name]
    except (KeyError, TypeError):
        raise PlanError(f"unknown schedule {name!r}: use one of {', '.join(_KINDS)}") from None


def names() -> tuple[str, ...]:
    return tuple(_KINDS)


def kinds() -> tuple[ScheduleKind, ...]:
    return tuple(_KINDS.values())


def built_in() -> tuple[str, ...]:
    """The names of the schedules every lab process knows without being told."""
    return tuple(k.name for k in BUILT_IN)


def added() -> list[ScheduleKind]:
    """The schedules registered beyond the built-in ones (what a session hands its workers)."""
    return [k for k in _KINDS.values() if all(k is not b for b in BUILT_IN)]


def virtual_refusal(name: str, virtual: int) -> str | None:
    """Why schedule ``name`` cannot run ``virtual`` chunks per stage (naming the schedules that chunk), if it cannot."""
    problem = get(name).check_virtual(virtual)
    if problem and not get(name).chunked:
        problem += f" (the chunked ones: {', '.join(k.name for k in _KINDS.values() if k.chunked)})"
    return problem


def job_refusal(name: str, *, stages: int, microbatches: int, virtual_stages: int | None = None,
                clip_grad_norm: float | None = None, precision: str = "fp32", replicas: int = 1) -> str | None:
    """Why a job cannot train with schedule ``name`` and these settings (None: it can). launch(), live changes, the
    command line and torchrun workers all ask here, so each refusal is said once."""
    if name not in _KINDS:
        return f"unknown schedule {name!r}: use one of {', '.join(_KINDS)}"
    kind = _KINDS[name]
    virtual = kind.default_virtual if virtual_stages is None else virtual_stages
    if virtual > 1 and stages < 2:
        return f"virtual_stages={virtual} needs at least 2 stages (got {stages})"
    return (virtual_refusal(name, virtual) or kind.check(stages, microbatches)
            or kind.training_refusal(clip_grad_norm, precision, replicas))
