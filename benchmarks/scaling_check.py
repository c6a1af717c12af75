"""Is a profile taken at one micro-batch size good for another? gpt-tiny on 2 CPU ranks, everything kept on the even
split: a run at M = 4 (8 samples per micro-batch) gives the profile the planner rescales; a run at M = 16 (2 samples)
is measured and predicted from that rescaled profile, and from its own.

    python benchmarks/scaling_check.py [--rounds 3]

Both runs step after the boundary's agreement (an unreachable memory budget), as budgeted runs do; each round runs
the two back to back, so drift between them stays small. Prints per-layer times at size 2 (rescaled against
measured) and the M = 16 period: measured (iteration span + time between iterations) against predicted.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import vpipe_lab
from vpipe_lab import Plan
from vpipe_lab.core.cost import scaling
from vpipe_lab.core.cost.simulator import period_s


def run(m: int) -> dict[str, Any]:
    plan = Plan((0, 4, 8), ("keep",) * 8, m, "1f1b")
    with vpipe_lab.launch("gpt-tiny", stages=2, microbatches=m, plan=plan, device="cpu", timeout=300,
                          memory_budget=1 << 50) as s:
        s.run(12)
        s.wait(timeout=300)
        spans = s.metrics.iterations["time_s"].tolist()[4:]  # after the profiling iterations
        cluster = s.cluster()
        return {"profile": s.profile(), "cluster": cluster,
                "period_s": statistics.median(spans) + cluster.iteration_overhead_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    plan16 = Plan((0, 4, 8), ("keep",) * 8, 16, "1f1b")
    for r in range(args.rounds):
        at4, at16 = run(4), run(16)
        scaled = scaling.at(at4["profile"], 2)
        if r == 0:
            print("forward ms per layer at 2 samples, rescaled from 8:",
                  [round(x.forward_s * 1e3, 3) for x in scaled.layers])
            print("forward ms per layer at 2 samples, measured:       ",
                  [round(x.forward_s * 1e3, 3) for x in at16["profile"].layers])
        from_4 = period_s(plan16, scaled, at4["cluster"])
        own = period_s(plan16, at16["profile"], at16["cluster"])
        print(f"round {r}: M=16 measured {at16['period_s'] * 1e3:.1f} ms; predicted from the M=4 profile "
              f"{from_4 * 1e3:.1f} ({from_4 / at16['period_s']:.2f}), from its own {own * 1e3:.1f} "
              f"({own / at16['period_s']:.2f})", flush=True)


if __name__ == "__main__":
    main()
