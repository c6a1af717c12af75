"""Planning at scale, in simulation: the planner and the simulator on 64 to 1024 stages, and the paper's multi-GPU
comparison reproduced from the bundled profiles.

    python benchmarks/scale.py

1. Planner time and the planner's own peak memory (tracemalloc) for vpipe and optimal, and the simulator's time, on
   K in {64, 128, 256, 512, 1024} stages of a seeded random chain with 4K layers at 80% memory, M = 2K.
2. vPipe against GPipe (even split, recompute everything) and PipeDream (min-bottleneck, keep everything) on the
   paper's workloads across 4, 8, 16 and 32 RTX 2080 Ti, M = 2K, beside the paper's reported range.
"""

from __future__ import annotations

import math
import time
import tracemalloc

from vpipe_lab.core.cost.simulator import simulate
from vpipe_lab.core.errors import InfeasiblePlan
from vpipe_lab.core.planning.planner import search
from vpipe_lab.core.workloads import cluster, pressured_cluster, random_chain, workload


def measured(fn, memory: bool = True):  # type: ignore[no-untyped-def]
    """(result, seconds, peak bytes): timed in a plain run, memory in a second run under tracemalloc, which slows
    allocation-heavy code several-fold and so must not be inside the timing."""
    t = time.perf_counter()
    out = fn()
    elapsed = time.perf_counter() - t
    peak = 0
    if memory:
        tracemalloc.start()
        fn()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return out, elapsed, peak


def part_scale() -> None:
    print("## Planner and simulator on 64-1024 stages (4K layers, 80% memory, M = 2K)\n")
    print("| stages | layers | vpipe time | vpipe peak memory | optimal time | optimal peak memory | optimal / vpipe "
          "iteration | simulate time |")
    print("|---|---|---|---|---|---|---|---|")
    for k in (64, 128, 256, 512, 1024):
        n, m = 4 * k, 2 * k
        profile = random_chain(n, seed=1)
        cl = pressured_cluster(profile, k, m, pressure=0.8)
        v, tv, mv = measured(lambda p=profile, c=cl, m=m: search(p, c, microbatches=m, method="vpipe"))
        if k <= 128:
            o, to, mo = measured(lambda p=profile, c=cl, m=m: search(p, c, microbatches=m, method="optimal"))
            opt = (f"{to:.2f} s | {mo / 2**20:.1f} MiB | {o.estimate.iteration_s / v.estimate.iteration_s:.4f}")
        else:
            opt = "not run | | "
        _, ts, _ = measured(lambda p=v.plan, pr=profile, c=cl: simulate(p, pr, c), memory=False)
        print(f"| {k} | {n} | {tv:.2f} s | {mv / 2**20:.1f} MiB | {opt} | {ts:.2f} s |", flush=True)


def part_paper() -> None:
    print("\n## The paper's multi-GPU comparison from the bundled profiles (RTX 2080 Ti, M = 2K)\n")
    print("Gain = baseline iteration time / vPipe's - 1, under the cost model. Paper (real GPUs): +24.8..291.3% over "
          "GPipe, +61.4..463.4% over PipeDream.\n")
    print("| workload | GPUs | vPipe (s) | vs GPipe | vs PipeDream |")
    print("|---|---|---|---|---|")

    def t(profile, cl, m, method):  # type: ignore[no-untyped-def]
        try:
            r = search(profile, cl, microbatches=m, method=method)
            return r.estimate.iteration_s if r.estimate.feasible else math.inf
        except InfeasiblePlan:
            return math.inf

    for name, b in (("bert-48", 8), ("transformer-12-12", 32), ("gpt-cpm-large", 2)):
        profile = workload(name, microbatch_size=b)
        for k in (4, 8, 16, 32):
            cl = cluster("rtx2080ti", k)
            v, g, p = (t(profile, cl, 2 * k, m) for m in ("vpipe", "gpipe", "pipedream"))
            if math.isinf(v):
                print(f"| {name} (micro-batch {b}) | {k} | does not fit | | |")
                continue
            vs_g = "GPipe does not fit" if math.isinf(g) else f"+{g / v - 1:.1%}"
            vs_p = "PipeDream does not fit" if math.isinf(p) else f"+{p / v - 1:.1%}"
            print(f"| {name} (micro-batch {b}) | {k} | {v:.3f} | {vs_g} | {vs_p} |", flush=True)


if __name__ == "__main__":
    part_scale()
    part_paper()
