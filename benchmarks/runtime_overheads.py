"""Telemetry cost, measured-vs-predicted iteration time, and pipeline efficiency against the bubble limit.

    python benchmarks/runtime_overheads.py [--iterations 30] [--rounds 3]

1. Telemetry: throughput with event streaming (spans + memory per iteration) on and off, alternating runs.
2. Prediction: measured median iteration time against the cost model and the simulator, both fed with the online
   profile and the measured cluster (Session.profile(), Session.cluster()) of the same run.
3. Efficiency: busy time / (K x iteration time) from the measured spans, against the bubble limit
   1 - (K - 1) / (M + K - 1), for M in {1, 2, 4, 8}, with 1F1B and eager 1F1B run back to back; and each
   iteration against its own compute bound (``core.cost.simulator.compute_bound_s``: the schedule replayed with that
   iteration's measured compute and free transfers, the bubble limit of the stages as they ran).
All runs: 2 CPU ranks, gloo, one thread per rank.
"""

from __future__ import annotations

import argparse
import statistics

import vpipe_lab
from vpipe_lab import Plan
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.cost.simulator import compute_bound_s, simulate
from vpipe_lab.core.schedules.builders import for_plan

WARMUP = 3


def run(name: str, m: int, iterations: int, *, telemetry: bool = True, schedule: str = "1f1b",
        policies: str | None = None) -> dict:  # type: ignore[type-arg]
    n = 8 if name == "gpt-tiny" else 10
    bounds = (0, n // 2, n)
    plan = Plan(bounds, tuple(policies or "k" * n), m, schedule)
    with vpipe_lab.launch(name, stages=2, microbatches=m, schedule=schedule, plan=plan, device="cpu",
                          telemetry=telemetry, timeout=300) as s:
        s.run(WARMUP + iterations)
        s.wait(timeout=1800)
        frame = s.metrics.iterations
        timed = frame[frame["iteration"] >= WARMUP]
        out = {
            "period": float(timed["end_s"].max() - timed["start_s"].min()) / iterations,
            "median": float(timed["time_s"].median()),
        }
        if telemetry:
            profile, cluster = s.profile(), s.cluster()
            out["estimate"] = estimate(s.plan, profile, cluster).iteration_s
            out["simulated"] = simulate(s.plan, profile, cluster).iteration_s
            tl = s.metrics.timeline(iterations)
            its = sorted({sp.iteration for sp in tl})[1:]
            eff, top, bound = [], [], []
            schedule = for_plan(s.plan)
            for it in its:
                t = tl.select(iteration=it)
                busy = [t.busy_s(st) for st in range(2)]
                eff.append(sum(busy) / (2 * t.iteration_s))
                top.append(max(busy) / t.iteration_s)
                bound.append(compute_bound_s(schedule, t) / t.iteration_s)
            out["efficiency"] = statistics.median(eff)
            out["bottleneck"] = statistics.median(top)
            out["of_bound"] = statistics.median(bound)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-telemetry", action="store_true", help="only the prediction and efficiency tables")
    ap.add_argument("--only-efficiency", action="store_true", help="only the efficiency table")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8], help="the efficiency table's M")
    args = ap.parse_args()

    if not args.skip_telemetry and not args.only_efficiency:
        telemetry(args)
    if not args.only_efficiency:
        predictions(args)
    efficiency(args)


def telemetry(args: argparse.Namespace) -> None:
    print("## Telemetry cost (gpt-tiny, 1F1B, M = 4)\n")
    print("One session alternates blocks of 10 iterations with span streaming on and off (Session.set_telemetry),")
    print("so both modes share processes, caches and machine noise.\n")
    blocks = {True: [], False: []}
    with vpipe_lab.launch("gpt-tiny", stages=2, microbatches=4, device="cpu", timeout=300) as s:
        s.run(WARMUP)
        s.wait(timeout=600)
        for block in range(2 * args.rounds * 2):
            on = block % 2 == 0
            first = s.set_telemetry(on)
            s.run(10)
            s.wait(timeout=600)
            frame = s.metrics.iterations
            part = frame[frame["iteration"] >= first + 1]  # the first iteration may straddle the switch
            blocks[on].append(float((part["end_s"].max() - part["start_s"].min()) / max(1, len(part))))
    a, b = statistics.median(blocks[True]), statistics.median(blocks[False])
    print(f"| streaming on (ms/it) | streaming off (ms/it) | throughput lost to streaming |\n|---|---|---|\n"
          f"| {1e3 * a:.1f} | {1e3 * b:.1f} | {100 * (1 - b / a):+.1f}% |\n", flush=True)


def predictions(args: argparse.Namespace) -> None:

    print("## Measured iteration time against the cost model and the simulator (online profile)\n")
    print("| model | schedule | M | policies | measured (ms) | cost model (ms) | simulator (ms) | sim / measured |")
    print("|---|---|---|---|---|---|---|---|")
    for name, schedule, m, pol in (("gpt-tiny", "1f1b", 4, None), ("gpt-tiny", "gpipe", 4, None),
                                   ("gpt-tiny", "1f1b", 8, None), ("gpt-tiny", "1f1b", 4, "krsrkskk"),
                                   ("mlp", "1f1b", 4, None), ("mlp", "gpipe", 8, None)):
        r = run(name, m, args.iterations, schedule=schedule, policies=pol)
        print(f"| {name} | {schedule} | {m} | {pol or 'keep'} | {1e3 * r['median']:.1f} | {1e3 * r['estimate']:.1f} | "
              f"{1e3 * r['simulated']:.1f} | {r['simulated'] / r['median']:.3f} |", flush=True)



def efficiency(args: argparse.Namespace) -> None:
    print("\n## Pipeline efficiency against the bubble limit (gpt-tiny, K = 2)\n")
    print("Efficiency = busy time of both stages / (2 x iteration time); it also falls when the stages' loads differ.")
    print("The busiest stage's share of the iteration shows the runtime's own waiting on the critical path.")
    print("Both schedules have the same fill and drain, so the same bubble limit; each M runs them back to back.")
    print("Compute bound / measured: each iteration's schedule replayed with its own measured compute and free")
    print("transfers, over its measured time (1.0 = no runtime overhead on the critical path).\n")
    print("| M | schedule | measured efficiency | bubble limit 1 - (K-1)/(M+K-1) | measured / limit "
          "| busiest stage busy share | busiest / limit | compute bound / measured | ms/it |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in args.microbatches:
        for schedule in ("1f1b", "eager-1f1b"):
            r = run("gpt-tiny", m, max(10, args.iterations // 2), schedule=schedule)
            limit = 1 - 1 / (m + 1)
            print(f"| {m} | {schedule} | {r['efficiency']:.3f} | {limit:.3f} | {r['efficiency'] / limit:.3f} "
                  f"| {r['bottleneck']:.3f} | {r['bottleneck'] / limit:.3f} | {r['of_bound']:.3f} "
                  f"| {1e3 * r['median']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
