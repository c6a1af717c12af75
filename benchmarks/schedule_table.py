"""Each schedule's predicted gain over 1F1B on the paper's GPU workloads, by micro-batches and stages (simulator).

    python benchmarks/schedule_table.py [--device rtx2080ti] [--workloads bert-48 gpt-cpm-large]

For every bundled workload, stage count K and micro-batch count M, each schedule is planned on its own (vPipe's
search for GPipe, 1F1B and ZB-H1; the chunk planner of ``core/planning/planner.py`` for interleaved 1F1B with V = 2 and 4 and
for ZBV),
its plan is replayed by the simulator (``core/cost/simulator.py``), and the table gives 1F1B's simulated time over each
one's (above 1: faster than 1F1B); "-" where the schedule fits no plan in the device's memory. Every number comes from
the cost model and the analytic profiles of ``core/workloads.py``: no device runs here, the memory budgets are the
device's.
"""

from __future__ import annotations

import argparse

from vpipe_lab.core import workloads
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.errors import InfeasiblePlan, PlanError
from vpipe_lab.core.planning.planner import search

CANDIDATES = (("gpipe", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("zbv", 2))


def simulated(name: str, device: str, k: int, m: int, schedule: str, virtual: int) -> float | None:
    profile, cluster = workloads.workload(name, device=device), workloads.cluster(device, k)
    try:
        plan = search(profile, cluster, microbatches=m, schedule=schedule, virtual_stages=virtual).plan
    except (InfeasiblePlan, PlanError):
        return None
    return simulate(plan, profile, cluster).iteration_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="rtx2080ti", choices=sorted(workloads.DEVICES))
    ap.add_argument("--workloads", nargs="+", default=["bert-48", "transformer-12-12", "gpt-cpm-large"])
    ap.add_argument("--stages", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--microbatches", nargs="+", type=int, default=[8, 16, 32])
    args = ap.parse_args()
    labels = [s if v == 1 or s == "zbv" else f"{s} V={v}" for s, v in CANDIDATES]
    print("| workload | K | M | 1f1b simulated (s) | " + " | ".join(f"{label} vs 1f1b" for label in labels) + " |")
    print("|---|---|---|---|" + "---|" * len(labels))
    for name in args.workloads:
        for k in args.stages:
            for m in args.microbatches:
                base = simulated(name, args.device, k, m, "1f1b", 1)
                cells = []
                for schedule, v in CANDIDATES:
                    t = simulated(name, args.device, k, m, schedule, v)
                    cells.append("-" if t is None or base is None else f"{base / t:.3f}")
                print(f"| {name} | {k} | {m} | {'-' if base is None else f'{base:.3f}'} | " + " | ".join(cells) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
