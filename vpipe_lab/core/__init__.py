"""Pure planning core of vpipe_lab: values, cost model, schedule IR, simulator and planners (standard library only)."""

from vpipe_lab.core.change import Applied, Change
from vpipe_lab.core.cost.costmodel import CostModel, estimate
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.deprecated import moved
from vpipe_lab.core.errors import InfeasiblePlan, PlanError, ProfileError, ScheduleError, VpipeError
from vpipe_lab.core.plan import Estimate, Plan, Policy
from vpipe_lab.core.planning.layer_moves import LayerMove, layer_moves, match_layers, migration_time_s, moved_bytes
from vpipe_lab.core.planning.mesh import MeshResult, search_sharded
from vpipe_lab.core.planning.mesh import choose as choose_mesh
from vpipe_lab.core.planning.methods import METHODS
from vpipe_lab.core.planning.planner import PlanResult, plan, search
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile
from vpipe_lab.core.schedules import actions as _actions
from vpipe_lab.core.schedules.actions import Action, Op, Schedule
from vpipe_lab.core.schedules.builders import for_plan, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from vpipe_lab.core.timeline import KINDS, Span, Timeline

# The schedule IR's module was core/schedule.py beside the core/schedules/ package (one name, two things).
moved(f"{__name__}.schedule", _actions)

__all__ = [
    "KINDS",
    "METHODS",
    "Action",
    "Applied",
    "Change",
    "Cluster",
    "CostModel",
    "Estimate",
    "InfeasiblePlan",
    "LayerCost",
    "LayerMove",
    "MeshResult",
    "ModelProfile",
    "Op",
    "Plan",
    "PlanError",
    "PlanResult",
    "Policy",
    "ProfileError",
    "Schedule",
    "ScheduleError",
    "Span",
    "Timeline",
    "VpipeError",
    "choose_mesh",
    "estimate",
    "for_plan",
    "gpipe",
    "interleaved_1f1b",
    "layer_moves",
    "match_layers",
    "migration_time_s",
    "moved_bytes",
    "one_f_one_b",
    "plan",
    "search",
    "search_sharded",
    "simulate",
    "zb_h1",
]
