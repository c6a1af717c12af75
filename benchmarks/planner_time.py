"""Planner wall time per method for L in {64, 256, 1024} layers and K in {4, 16, 64} stages, plus vPipe's refinement.

    python benchmarks/planner_time.py [--repeats 3] [--methods vpipe optimal] [--pressures 2.0 0.8 0.6 0.05]

Random heterogeneous chains (seeded), with the memory budget at 2.0 (no pressure), 0.8 and 0.6 of what an even,
everything-kept split needs; M = 2K micro-batches, 1F1B. Prints a markdown table (median of the repeats).
"""

from __future__ import annotations

import argparse
import statistics
import time

from vpipe_lab.core.errors import InfeasiblePlan
from vpipe_lab.core.planning.planner import search
from vpipe_lab.core.profile import LayerCost, ModelProfile
from vpipe_lab.core.workloads import pressured_cluster, random_chain

METHODS = ("uniform", "balanced", "pipedream", "vpipe", "optimal")


def timed(fn, repeats: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        try:
            out = fn()
        except InfeasiblePlan as exc:
            out = exc
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def drifted(profile: ModelProfile, factor: float, every: int) -> ModelProfile:
    """Some layers got slower: what online replanning sees after measured times drift."""
    return ModelProfile(tuple(
        LayerCost(x.name, x.forward_s * (factor if i % every == 0 else 1), x.backward_s * (factor if i % every == 0 else 1),
                  x.activation_bytes, x.input_bytes, x.output_bytes, x.param_bytes, x.optimizer_bytes)
        for i, x in enumerate(profile.layers)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--pressures", nargs="+", type=float, default=[2.0, 0.8, 0.6],
                    help="budgets as fractions of an even kept split's need (0.05: nothing fits)")
    args = ap.parse_args()
    print("| L | K | memory | " + " | ".join(args.methods) + " | optimal proven |", flush=True)
    print("|---|---|---|" + "---|" * (len(args.methods) + 1))
    for n in (64, 256, 1024):
        for k in (4, 16, 64):
            if k * 4 > n:
                continue
            profile = random_chain(n, seed=1)
            for pressure in args.pressures:
                cluster = pressured_cluster(profile, k, 2 * k, pressure=pressure)
                cells, proven = [], ""
                for method in args.methods:
                    secs, out = timed(lambda p=profile, c=cluster, k=k, m=method: search(p, c, microbatches=2 * k, method=m),
                                      args.repeats)
                    tag = " (no fit)" if isinstance(out, InfeasiblePlan) or not out.estimate.feasible else ""
                    cells.append(f"{secs * 1e3:.1f} ms{tag}")
                    if method == "optimal" and not isinstance(out, InfeasiblePlan):
                        proven = "yes" if out.proven_optimal else f"no (gap <= {out.gap:.2%})"
                print(f"| {n} | {k} | {pressure:.0%} | " + " | ".join(cells) + f" | {proven} |", flush=True)
    print()
    print("vPipe refinement from the running plan after 20% of layers slowed 1.5x (online replanning):")
    print()
    print("| L | K | memory | refine from current | plan from scratch | layers moved |")
    print("|---|---|---|---|---|---|")
    for n, k in ((256, 16), (1024, 64)):
        profile = random_chain(n, seed=1)
        for pressure in (2.0, 0.8):
            cluster = pressured_cluster(profile, k, 2 * k, pressure=pressure)
            current = search(profile, cluster, microbatches=2 * k, method="vpipe").plan
            slow = drifted(profile, 1.5, 5)
            t_ref, res = timed(lambda s=slow, c=cluster, k=k, cur=current: search(
                s, c, microbatches=2 * k, method="vpipe", current=cur), args.repeats)
            t_new, _ = timed(lambda s=slow, c=cluster, k=k: search(s, c, microbatches=2 * k, method="vpipe"),
                             args.repeats)
            print(f"| {n} | {k} | {pressure:.0%} | {t_ref * 1e3:.1f} ms | {t_new * 1e3:.1f} ms | {len(res.moves)} |")


if __name__ == "__main__":
    main()
