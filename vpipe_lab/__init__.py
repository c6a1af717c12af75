"""vpipe_lab: vPipe's online planner and live layer migration as an interactive pipeline-parallel tuning lab."""

from __future__ import annotations

from typing import Any

from vpipe_lab.core import (
    KINDS,
    METHODS,
    Action,
    Applied,
    Change,
    Cluster,
    CostModel,
    Estimate,
    InfeasiblePlan,
    LayerCost,
    LayerMove,
    MeshResult,
    ModelProfile,
    Op,
    Plan,
    PlanError,
    PlanResult,
    Policy,
    ProfileError,
    Schedule,
    ScheduleError,
    Span,
    Timeline,
    VpipeError,
    choose_mesh,
    estimate,
    for_plan,
    layer_moves,
    plan,
    search,
    search_sharded,
    simulate,
)
from vpipe_lab.core.report import plan_table
from vpipe_lab.core.settings import Settings

__version__ = "0.1.0"

# A PyPI torchvision next to a CPU-only torch cannot load its compiled ops, and its import error takes transformers
# down too: the same guard the workers run covers this process, from the first lookup of torchvision (import_guard.py).
from vpipe_lab import import_guard as _import_guard

_import_guard.arm()

__all__ = [
    "KINDS", "METHODS", "Action", "Applied", "Change", "Cluster", "CostModel", "Estimate", "InfeasiblePlan",
    "LayerCost", "LayerMove", "MeshResult",
    "ModelProfile", "Op", "Plan", "PlanError", "PlanResult", "Policy", "ProfileError", "Schedule", "ScheduleError", "Settings",
    "Span", "Timeline", "VpipeError", "__version__", "choose_mesh", "estimate", "for_plan", "layer_moves", "plan",
    "plan_table", "search", "search_sharded", "simulate",
]

# The process-side API is imported on first use, so `import vpipe_lab` stays light (no sockets, no torch).
_LAZY = {
    "launch": "vpipe_lab.control.launch",
    "attach": "vpipe_lab.control.launch",
    "Session": "vpipe_lab.control.session",
    "WorkerError": "vpipe_lab.control.errors",
    "BudgetError": "vpipe_lab.control.errors",
    "DataError": "vpipe_lab.control.errors",
    "NonFiniteLoss": "vpipe_lab.control.errors",
    "import_plan": "vpipe_lab.control.changes.interop",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vpipe_lab' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext vpipe_lab` registers the %vpipe magics."""
    from vpipe_lab.jupyter.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from vpipe_lab.jupyter.magics import unload_ipython_extension as unload

    unload(ipython)
