from vpipe_lab.core.costmodel import estimate
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.report import human_bytes, human_time, plan_table
from vpipe_lab.core.workloads import cluster, workload


def test_units() -> None:
    assert human_bytes(3 * 2**30) == "3.00 GiB" and human_bytes(512) == "512 B"
    assert human_time(2.5) == "2.500 s" and human_time(0.0025) == "2.50 ms" and human_time(2e-6) == "2.0 us"


def test_plan_table_flags_budget_and_bottleneck() -> None:
    profile = workload("bert-48")
    cl = cluster("rtx2080ti", 4)
    p = Plan.from_counts([25, 24, 24, 24], 8).with_policies({1: "swap", 2: "recompute"})
    text = plan_table(p, estimate(p, profile, cl), profile)
    assert "OVER BUDGET" in text and "DOES NOT FIT" in text
    assert "0:25 (embedding..ffn11)" in text and "1 swap, 1 recompute" in text
    assert text.splitlines()[0].startswith("stage")
