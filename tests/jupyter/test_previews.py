"""The editor's what-if numbers (jupyter/previews.py): one simulation per plan under a profile, kept for a bounded
number of plans, and scaled by a calibration with the raw simulation kept."""

from __future__ import annotations

import pytest

from vpipe_lab.core.cost.calibration import Calibration
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster
from vpipe_lab.core.workloads import random_chain
from vpipe_lab.jupyter import previews
from vpipe_lab.jupyter.previews import Previews, calibrated


def test_a_plans_doc_is_its_simulation_and_grid_computed_once() -> None:
    profile, cluster = random_chain(8, seed=3), Cluster(2, 10**12, 1e9, 1e9)
    plan = Plan.from_counts([3, 5], 4)
    cache = Previews()
    doc = cache.doc(plan, profile, cluster)
    assert doc["iteration_s"] == simulate(plan, profile, cluster).iteration_s
    assert len(doc["stage_s"]) == 2 and doc["feasible"] and doc["grid_csv"].startswith("step,rank 0,rank 1")
    assert cache.doc(plan, profile, cluster) is doc and len(cache) == 1  # once per plan
    assert cache.timeline(plan) is not None and cache.timeline(None) is None
    assert cache.timeline(Plan.from_counts([4, 4], 4)) is None  # not previewed
    cache.clear()
    assert len(cache) == 0 and cache.timeline(plan) is None


def test_the_cache_keeps_the_newest_plans_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(previews, "KEEP", 3)
    profile, cluster = random_chain(8, seed=3), Cluster(2, 10**12, 1e9, 1e9)
    plans = [Plan.from_counts([n, 8 - n], 4) for n in range(1, 6)]
    cache = Previews()
    for plan in plans:
        cache.doc(plan, profile, cluster)
    assert len(cache) == 3 and cache.timeline(plans[0]) is None and cache.timeline(plans[-1]) is not None


def test_calibrated_scales_every_plan_and_keeps_the_simulation() -> None:
    docs = {"current": {"iteration_s": 0.1, "stage_s": [0.05]}, "draft": {"iteration_s": 0.2}, "error": "why"}
    assert calibrated(docs, None) is docs
    out = calibrated(docs, Calibration(0.15, 0.1, 50))
    assert out["current"]["iteration_s"] == pytest.approx(0.15) and out["current"]["simulated_s"] == 0.1
    assert out["draft"]["iteration_s"] == pytest.approx(0.3) and out["error"] == "why"
    assert out["calibration"].startswith("x1.500: the running plan measured 150.00 ms")
    assert docs["current"]["iteration_s"] == 0.1  # the docs themselves are not changed


def test_the_what_if_the_page_names_is_found_among_those_sent_else_the_last() -> None:
    shown = previews.Shown(keep=2)
    assert shown.last is None and shown.seen(0.1) is None
    a, b, c = Plan.from_counts([3, 5], 4), Plan.from_counts([4, 4], 4), Plan.from_counts([5, 3], 4)
    shown.sent(a, 0.1)
    shown.sent(b, 0.2)
    assert shown.seen(0.1) == (a, 0.1) and shown.seen(None) == (b, 0.2) and shown.seen(0.3) == (b, 0.2)
    shown.sent(c, 0.3)  # keeps two: the oldest is forgotten
    assert shown.seen(0.1) == (c, 0.3) and shown.seen(0.2) == (b, 0.2)
