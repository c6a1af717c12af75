"""Mixture-of-experts models planned by their real memory: each stage's peak predicted before launch against what the
allocator really held, and the planner's split under a budget that binds against the best even split that fits.

    python benchmarks/moe_memory.py [--model moe-tiny] [--iterations 12] [--rounds 2] [--budgets 0.75 0.6]
                                    [--skip-prediction]

1. A profiling run (2 stages, the even split, everything kept) gives the profile: each layer's times, activations,
   parameters and optimizer state, and its working set and optimizer-step scratch measured off the allocator.
2. From that profile alone, before each launch, the cost model predicts every stage's peak for a set of plans (2 and
   4 stages; keep, recompute, swap; 1F1B and ZB-H1); each plan is then trained and its peak read off the allocator
   (``metrics.memory``'s ``allocated_peak``: torch.profiler's memory events on CPU, ``max_memory_allocated`` on CUDA).
   On CPU a swapped layer's host copy lives in the same memory the allocator counts, so a swap plan is compared with
   its predicted device peak plus its host bytes.
3. For each of ``--budgets`` (fractions of the even split's largest kept peak) the budget binds: vPipe's planner
   (and the exact one) search the split and the per-layer keep/swap/recompute plan under it; the even split gets the
   fastest memory plan that fits (the exact per-stage search). Each distinct plan is trained under the budget in
   alternating rounds; the medians of their iterations are compared, with each one's measured peak against the
   budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vpipe_lab
from vpipe_lab import Plan, search
from vpipe_lab.core.cost.costmodel import CostModel, estimate
from vpipe_lab.core.plan import Policy
from vpipe_lab.core.planning.memory_plans import StageProblem
from vpipe_lab.core.planning.memory_search import exact
from vpipe_lab.core.planning.partition import uniform
from vpipe_lab.core.report import human_bytes, human_time

WARMUP = 4


def train(model: str, plan: Plan, iterations: int, budget: int | None = None) -> dict[str, Any]:
    """Train ``plan``: its profile and cluster, each stage's allocator peak (the newest measured) and counted peak,
    and the median iteration after the warm-up."""
    with vpipe_lab.launch(model, stages=plan.stages, microbatches=plan.microbatches, schedule=plan.schedule, plan=plan,
                          virtual_stages=plan.virtual_stages, device="cpu", timeout=300, memory_budget=budget) as s:
        s.run(iterations)
        s.wait(timeout=1200)
        memory = s.metrics.memory
        last = memory[memory["iteration"] == memory["iteration"].max()].sort_values("stage")
        times = list(s.metrics.iterations["time_s"])[WARMUP:]
        return {"profile": s.profile(), "cluster": s.cluster(), "measured": [int(v) for v in last["allocated_peak"]],
                "counted": [int(v) for v in last["peak"]], "median_s": statistics.median(times)}


def predicted(plan: Plan, profile: Any, cluster: Any) -> tuple[list[int], list[int]]:
    """The cost model's peak per stage, and the same with the swapped activations' host copies (what a CPU holds)."""
    c = dataclasses.replace(cluster, stages=plan.stages, memory_bytes=cluster.budgets[0])
    est = estimate(plan, profile, c)
    return list(est.peak_bytes), [p + h for p, h in zip(est.peak_bytes, est.host_bytes)]


def even_with_memory_plan(profile: Any, cluster: Any, stages: int, m: int) -> Plan | None:
    """The even split with the fastest keep/swap/recompute plan per stage that fits (None if some stage cannot)."""
    bounds = tuple(uniform(len(profile.layers), stages))
    cm = CostModel(profile, cluster, m)
    policies: list[Policy] = []
    for s in range(stages):
        solution = exact(StageProblem.of(cm, s, bounds[s], bounds[s + 1]))
        if solution is None:
            return None
        policies += list(solution.policies)
    return Plan(bounds, tuple(policies), m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="moe-tiny")
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.75, 0.6])
    ap.add_argument("--skip-prediction", action="store_true", help="only the budgets (part 3)")
    args = ap.parse_args()
    n, m = 8, 4
    first = train(args.model, Plan((0, 4, 8), ("k",) * n, m), args.iterations)
    profile, cluster = first["profile"], first["cluster"]
    if not args.skip_prediction:
        print(f"## {args.model}: predicted before launch against the allocator's peak\n")
        print("| plan | stage | predicted | measured | error |")
        print("|---|---|---|---|---|")
        plans = [Plan((0, 4, 8), tuple("k" * n), m), Plan((0, 2, 4, 6, 8), tuple("k" * n), m),
                 Plan((0, 4, 8), tuple("krrrkrrk"), m), Plan((0, 5, 8), tuple("krrrrkkk"), m),
                 Plan((0, 2, 4, 6, 8), tuple("kkrrrrkk"), m), Plan((0, 4, 8), tuple("kkkkkkkk"), m, "zb-h1"),
                 Plan((0, 5, 8), tuple("kskrskrk"), m, "zb-h1")]
        errors = []
        for plan in plans:
            device, with_host = predicted(plan, profile, cluster)
            got = train(args.model, plan, args.iterations)
            swaps = any(p is Policy.SWAP for p in plan.policies)
            for stage, (pd, ph, meas) in enumerate(zip(device, with_host, got["measured"])):
                pred = ph if swaps else pd
                err = pred / meas - 1
                errors.append(abs(err))
                print(f"| {plan.describe()} | {stage} | {human_bytes(pred)}{' (with host copies)' if swaps else ''} | "
                      f"{human_bytes(meas)} | {100 * err:+.1f}% |", flush=True)
        print(f"\nlargest error {100 * max(errors):.1f}%, median {100 * statistics.median(errors):.1f}%\n")

    keep_peak = max(predicted(Plan((0, 4, 8), ("k",) * n, m), profile, cluster)[0])
    for fraction in args.budgets:
        under_budget(args, profile, cluster, int(fraction * keep_peak), fraction, n, m)


def under_budget(args: Any, profile: Any, cluster: Any, budget: int, fraction: float, n: int, m: int) -> None:
    bound = dataclasses.replace(cluster, stages=2, memory_bytes=budget)
    print(f"\n## under a budget of {human_bytes(budget)} a stage ({fraction:.0%} of the even split's kept peak)\n")
    candidates: dict[str, Plan] = {}
    for method in ("vpipe", "optimal"):
        candidates[method] = search(profile, bound, microbatches=m, method=method).plan
    even = even_with_memory_plan(profile, bound, 2, m)
    if even is not None:
        candidates["even split + best memory plan"] = even
    distinct: dict[Plan, list[str]] = {}
    for name, plan in candidates.items():
        distinct.setdefault(plan, []).append(name)
    runs: dict[Plan, list[float]] = {plan: [] for plan in distinct}
    peaks: dict[Plan, list[int]] = {}
    for r in range(args.rounds):
        for plan in (list(distinct) if r % 2 == 0 else list(reversed(distinct))):
            got = train(args.model, plan, args.iterations, budget)
            runs[plan].append(got["median_s"])
            peaks[plan] = got["measured"]
    print("| plan | chosen by | predicted time | measured median | predicted peak per stage | measured peak per stage "
          "| fits |")
    print("|---|---|---|---|---|---|---|")
    for plan, names in distinct.items():
        est = estimate(plan, profile, bound)
        fits = all(p <= budget for p in peaks[plan])
        print(f"| {plan.describe()} | {', '.join(names)} | {human_time(est.iteration_s)} | "
              f"{human_time(statistics.median(runs[plan]))} | {', '.join(human_bytes(p) for p in est.peak_bytes)} | "
              f"{', '.join(human_bytes(p) for p in peaks[plan])} | {'yes' if fits else 'no'} |", flush=True)
    if even is not None:
        ratio = statistics.median(runs[candidates["vpipe"]]) / statistics.median(runs[even])
        print(f"\nvpipe's plan / the even split's: {ratio:.3f} of its iteration time (medians of {args.rounds} rounds)")

if __name__ == "__main__":
    main()
