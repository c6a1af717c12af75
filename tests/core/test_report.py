from vpipe_lab.core.cost.costmodel import estimate
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
    # every column has its name: the header's names line up with the rule under them, one word group per column
    header, rule = text.splitlines()[:2]
    assert header.split() == ["stage", "layers", "policies", "time/mb", "peak", "memory", "budget", "note"]
    assert len(rule.split()) == 7


def test_a_stage_s_neighbouring_chunks_read_as_one_range() -> None:
    """ZBV's last stage runs the two middle chunks back to back: one range; stage 0's two stay apart."""
    profile = workload("bert-48")
    p = Plan((0, 20, 48, 70, 97), ("keep",) * 97, 4, "zbv", 2)
    text = plan_table(p, estimate(p, profile, cluster("rtx2080ti", 2)))
    rows = text.splitlines()
    assert rows[2].split()[1:3] == ["0:20,", "70:97"] and rows[3].split()[1] == "20:70"

