"""Schedules as objects: each a ``ScheduleKind`` in a module of its own, and the registry that names them.

``get("zbv")`` is the schedule the lab means by that name: its placement, whether it chunks, splits the backward or
updates per micro-batch, its order (the IR, ``build``), its checks and its costs, and torch's class for it. Add a
schedule by subclassing ``ScheduleKind`` (a name and ``orders``; the costs default to what its order implies) and
``register(instance)``; a built-in one is a module here and a line in ``registry.BUILT_IN``.
"""

from __future__ import annotations

from vpipe_lab.core.schedules.kind import ScheduleKind, Step, TorchSchedule
from vpipe_lab.core.schedules.registry import (
    added,
    built_in,
    get,
    job_refusal,
    kinds,
    names,
    register,
    unregister,
    virtual_refusal,
)

__all__ = ["ScheduleKind", "Step", "TorchSchedule", "added", "built_in", "get", "job_refusal", "kinds", "names", "register",
           "unregister", "virtual_refusal"]
