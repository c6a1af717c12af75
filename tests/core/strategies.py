"""Hypothesis strategies and a brute-force oracle shared by the core tests."""

from __future__ import annotations

import itertools
import math

from hypothesis import strategies as st

from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.plan import Plan, Policy
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile


@st.composite
def layers(draw: st.DrawFn, min_layers: int = 1, max_layers: int = 6) -> ModelProfile:
    n = draw(st.integers(min_layers, max_layers))
    out = []
    for i in range(n):
        act = draw(st.integers(1, 100)) * 1000
        out.append(LayerCost(
            f"l{i}",
            forward_s=draw(st.floats(0.1, 2.0)),
            backward_s=draw(st.floats(0.1, 4.0)),
            activation_bytes=act,
            input_bytes=draw(st.integers(0, act // 1000)) * 1000,
            output_bytes=draw(st.integers(1, 50)) * 100,
            param_bytes=draw(st.integers(1, 30)) * 1000,
            optimizer_bytes=draw(st.integers(0, 30)) * 1000,
        ))
    return ModelProfile(tuple(out))


@st.composite
def problems(draw: st.DrawFn, max_layers: int = 6, max_stages: int = 3) -> tuple[ModelProfile, Cluster, int, str]:
    """A profile, a cluster under some memory pressure, micro-batches and a schedule."""
    profile = draw(layers(2, max_layers))
    k = draw(st.integers(1, min(max_stages, len(profile))))
    m = draw(st.integers(1, 5))
    schedule = draw(st.sampled_from(["1f1b", "gpipe"]))
    probe = CostModel(profile, Cluster(k, 10**12, 1e3, 1e4), m, schedule)
    keep_all = max(probe.keep_all_bytes(s, 0, len(profile)) for s in range(k))
    memory = max(1, int(keep_all * draw(st.floats(0.15, 1.2)) / k))
    cluster = Cluster(k, memory, draw(st.sampled_from([1e3, 1e4, 1e5])), 1e4,
                      shared_link=draw(st.booleans()))
    return profile, cluster, m, schedule


def exhaustive(profile: ModelProfile, cluster: Cluster, m: int, schedule: str) -> tuple[float, Plan | None]:
    """The best plan that fits by the estimate the user is shown (``Estimate.feasible``), by enumerating every
    partition and every per-layer policy; the memory planners' additive count (``CostModel.planned_peak_bytes``)
    never understates that peak."""
    cm = CostModel(profile, cluster, m, schedule)
    n, k = len(profile), cluster.stages
    best, best_plan = math.inf, None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        for policies in itertools.product(list(Policy), repeat=n):
            plan = Plan(bounds, policies, m, schedule)
            est = cm.estimate(plan)
            counted = all(cm.planned_peak_bytes(s, bounds[s], bounds[s + 1], policies) <= cm.budget(s)
                          for s in range(k))
            assert not counted or est.feasible  # what the planners count never understates the estimate's peak
            if est.feasible and est.iteration_s < best:
                best, best_plan = est.iteration_s, plan
    return best, best_plan


def binding_budget(profile: ModelProfile, stages: int, m: int, schedule: str, fraction: float) -> Cluster:
    """``stages`` stages whose budget is ``fraction`` of the estimate's peak with the whole model kept on the stage that
    holds the most micro-batches: below 1 it binds (fast links, so memory decides)."""
    probe = CostModel(profile, Cluster(stages, 10**15, 1e10, 1e10), m, schedule)
    keep = max(probe.keep_peak_bytes(s, 0, len(profile)) for s in range(stages))
    return Cluster(stages, int(keep * fraction), 1e10, 1e10, 1e-5)

