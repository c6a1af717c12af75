"""Predicted against measured iteration time of budgeted runs (2 CPU ranks): the cost model and the simulator with
swaps hidden under compute (as on a GPU's copy engine) and with swaps on the compute thread (what CPU ranks do).

    python benchmarks/budget_prediction.py [--models gpt-tiny gpt2] [--budgets 1.0 0.6 0.4] [--iterations 10]

For each model a first run (everything kept, a budget it never reaches) measures the profile and the cluster
(``Session.profile()``, ``Session.cluster()``, whose ``swap_overlaps`` is False on CPU ranks). Each budget gives every
stage of the even split its parameters and optimizer state plus a fraction of the activations it holds with everything
kept (the last stage, which holds one micro-batch under 1F1B, that nothing can free, keeps all of it); vPipe plans M =
4 twice, once believing swaps hide under compute (the model before ``Cluster.swap_overlaps``) and once knowing they do
not; each distinct plan is trained under the budget and its median iteration time set against both models' predictions
(cost model and simulator). The planner prefers recompute on these models, so fixed plans that swap (stage 0's layers
swapped, or swap and recompute mixed; run without a budget) show what each model makes of swaps.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

import torch
from paper_table import WARMUP, job, measure

import vpipe_lab
from vpipe_lab import Plan
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.errors import InfeasiblePlan
from vpipe_lab.core.plan import Policy
from vpipe_lab.core.planning.partition import uniform

M = 4
FORCED = ("ssss" + "kkkk", "srsk" + "kkkk", "kskr" + "skkk")  # 8 partition units: gpt-tiny's and this GPT-2's


def run(model: str, plan: Plan, budget: list[int] | None, iterations: int) -> float:
    """Train ``plan`` under ``budget``: its median iteration after the warm-up."""
    kwargs, _ = job(model)
    with vpipe_lab.launch(**kwargs, stages=2, microbatches=M, plan=plan, memory_budget=budget, device="cpu",
                          timeout=300, start_timeout=300) as s:
        s.run(WARMUP + iterations)
        s.wait(timeout=1800)
        frame = s.metrics.iterations
        return float(frame[frame["iteration"] >= WARMUP]["time_s"].median())


def rows(model: str, budgets: list[float], iterations: int) -> list[dict[str, Any]]:
    first = measure(model, 2, M)  # the paper table's profile run: everything kept, under a budget it never reaches
    profile, measured = first["profile"], first["cluster"]
    n = len(profile)
    even = estimate(Plan(uniform(n, 2), (Policy.KEEP,) * n, M, "1f1b"), profile, measured)
    out = []
    for fraction in budgets:
        budget = [int(st + (fraction if n > 1 else 1.0) * (peak - st))
                  for st, peak, n in zip(even.static_bytes, even.peak_bytes, even.inflight)]
        models = {"on compute": dataclasses.replace(measured, memory_bytes=tuple(budget), swap_overlaps=False),
                  "hidden": dataclasses.replace(measured, memory_bytes=tuple(budget), swap_overlaps=True)}
        plans: dict[Plan, str] = {}
        for name, cluster in models.items():
            try:
                found = vpipe_lab.search(profile, cluster, microbatches=M, method="vpipe").plan
            except InfeasiblePlan:
                continue
            plans[found] = plans.get(found, "") + ("+" if found in plans else "") + name
        for plan, planned in plans.items():
            got = run(model, plan, budget, iterations)
            row = {"model": model, "budget": fraction, "planned as": planned, "plan": plan.describe(),
                   "measured_s": got}
            for name, cluster in models.items():
                row[f"cost model ({name})"] = estimate(plan, profile, cluster).iteration_s / got
                row[f"simulator ({name})"] = simulate(plan, profile, cluster).iteration_s / got
            out.append(row)
            print(row, flush=True)
    for policies in FORCED:
        plan = Plan(uniform(n, 2), tuple(policies), M, "1f1b")
        got = run(model, plan, None, iterations)
        row = {"model": model, "budget": None, "planned as": "fixed", "plan": plan.describe(), "measured_s": got}
        for name, overlaps in (("on compute", False), ("hidden", True)):
            cluster = dataclasses.replace(measured, swap_overlaps=overlaps)
            row[f"cost model ({name})"] = estimate(plan, profile, cluster).iteration_s / got
            row[f"simulator ({name})"] = simulate(plan, profile, cluster).iteration_s / got
        out.append(row)
        print(row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["gpt-tiny", "gpt2"])
    ap.add_argument("--budgets", nargs="+", type=float, default=[1.0, 0.6, 0.4])
    ap.add_argument("--iterations", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    found = [r for model in args.models for r in rows(model, args.budgets, args.iterations)]
    keys = [k for k in found[0] if k.startswith(("cost model", "simulator"))] if found else []
    print("\n| model | budget | planned as | plan | measured (ms/it) | " + " | ".join(f"{k} / measured" for k in keys)
          + " |")
    print("|---|---|---|---|---|" + "---|" * len(keys))
    for r in found:
        budget = "none" if r["budget"] is None else f"{r['budget']:.0%}"
        print(f"| {r['model']} | {budget} | {r['planned as']} | {r['plan']} | {1e3 * r['measured_s']:.1f} | "
              + " | ".join(f"{r[k]:.2f}" for k in keys) + " |")
    for k in keys:
        values = sorted(r[k] for r in found)
        print(f"{k}: median {statistics.median(values):.2f}, range {values[0]:.2f}-{values[-1]:.2f}, "
              f"within 0.9-1.1: {sum(0.9 <= v <= 1.1 for v in values)} of {len(values)}")


if __name__ == "__main__":
    main()
