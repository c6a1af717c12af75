"""A plan for another number of stages: the stages that remain when one cannot come back (its device or node is gone)
or the ranks torchrun's elastic membership gives a restarted job. vPipe's re-partition of the same layers, balanced by
what each layer was measured to cost."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vpipe_lab.core import checks
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.partition import balanced, uniform


@dataclass(frozen=True)
class Fewer:
    """The plan for the remaining stages, and in words how it was made (what the session says it did)."""

    plan: Plan
    how: str


def spread(plan: Plan, stage_seconds: Sequence[float]) -> list[float]:
    """Per-layer costs from per-stage ones (a stage's time shared evenly by its layers): what a re-plan balances
    when no per-layer profile was measured."""
    if len(stage_seconds) != plan.stages:
        raise PlanError(f"{len(stage_seconds)} stage times for a plan of {plan.stages} stages: give one per stage")
    times = [0.0] * plan.num_layers
    for stage, seconds in enumerate(stage_seconds):
        layers = list(plan.layers_of(stage))
        for layer in layers:
            times[layer] = max(0.0, float(seconds)) / len(layers)
    return times


def fewer_stages(plan: Plan, lost: int, layer_times: Sequence[float] | None = None) -> Fewer:
    """``plan`` on the stages that remain without stage ``lost`` (``onto`` one stage fewer)."""
    if not 0 <= lost < plan.stages:
        raise PlanError(f"stage {lost} is not one of the plan's {plan.stages} stages (0..{plan.stages - 1})")
    if plan.stages < 2:
        raise PlanError("a pipeline of one stage has no stage to fall back on: the job cannot go on without it")
    return onto(plan, plan.stages - 1, layer_times)


def onto(plan: Plan, stages: int, layer_times: Sequence[float] | None = None) -> Fewer:
    """``plan``'s layers and policies on ``stages`` stages, the partition balancing ``layer_times`` (the measured cost
    of each layer; equal layer counts without them). The schedule stays where it can run on that many stages;
    otherwise the plan falls back to 1F1B, and ``how`` says so."""
    checks.count(stages, "stages", error=PlanError)
    n = plan.num_layers
    if layer_times is not None and len(layer_times) != n:
        raise PlanError(f"{len(layer_times)} layer times for a plan of {n} layers: give one per layer")
    usable = layer_times is not None and sum(layer_times) > 0

    def cut(chunks: int) -> tuple[int, ...]:
        if usable:
            assert layer_times is not None
            # a layer measured at zero still needs a place: the smallest positive cost keeps every chunk non-empty
            floor = min(t for t in layer_times if t > 0) * 1e-3
            return balanced([max(float(t), floor) for t in layer_times], chunks)
        return uniform(n, chunks)

    basis = "balanced by the measured layer times" if usable else "equal layer counts (no measured layer times)"
    on = f"on {stages} stage{'s' if stages > 1 else ''}"
    try:
        kept = Plan(cut(stages * plan.virtual_stages), plan.policies, plan.microbatches, plan.schedule,
                    plan.virtual_stages).validate(n)
        return Fewer(kept, f"{plan.schedule} {on}, {basis}")
    except PlanError as exc:
        fallback = Plan(cut(stages), plan.policies, plan.microbatches, "1f1b").validate(n)
        return Fewer(fallback, f"1f1b {on}, {basis} ({plan.schedule} cannot run {on}: {exc})")
