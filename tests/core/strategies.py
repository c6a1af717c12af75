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
    partition and every per-layer policy. A stage's peak reads only its own layers' policies, so each stage's
    fitting choices are found first (3^n per stage by ``CostModel.peak_bytes``) and only their combinations are
    estimated; every one of them must then fit by the estimate itself. On the way: the memory planners' additive
    count (``CostModel.planned_peak_bytes``) never understates the peak."""
    cm = CostModel(profile, cluster, m, schedule)
    n, k = len(profile), cluster.stages
    best, best_plan = math.inf, None
    keep = [Policy.KEEP] * n
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        fitting: list[list[tuple[Policy, ...]]] = []
        for s in range(k):
            lo, hi, mine = bounds[s], bounds[s + 1], []
            for choice in itertools.product(list(Policy), repeat=bounds[s + 1] - bounds[s]):
                full = keep[:lo] + list(choice) + keep[hi:]
                fits = cm.peak_bytes(s, lo, hi, full) <= cm.budget(s)
                assert fits or cm.planned_peak_bytes(s, lo, hi, full) > cm.budget(s)  # the count never understates
                if fits:
                    mine.append(choice)
            fitting.append(mine)
        for choices in itertools.product(*fitting):
            plan = Plan(bounds, tuple(p for choice in choices for p in choice), m, schedule)
            est = cm.estimate(plan)
            assert est.feasible  # each stage's peak is the estimate's
            if est.iteration_s < best:
                best, best_plan = est.iteration_s, plan
    return best, best_plan


def binding_budget(profile: ModelProfile, stages: int, m: int, schedule: str, fraction: float) -> Cluster:
    """``stages`` stages whose budget is ``fraction`` of the estimate's peak with the whole model kept on the stage that
    holds the most micro-batches: below 1 it binds (fast links, so memory decides)."""
    probe = CostModel(profile, Cluster(stages, 10**15, 1e10, 1e10), m, schedule)
    keep = max(probe.keep_peak_bytes(s, 0, len(profile)) for s in range(stages))
    return Cluster(stages, int(keep * fraction), 1e10, 1e10, 1e-5)

