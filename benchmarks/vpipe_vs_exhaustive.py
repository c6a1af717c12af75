"""vPipe's search against exhaustive search (every split and per-layer policy) on small random chains under binding
budgets, by the estimate the user is shown: plans missed, instances over 2%, geometric mean and worst ratio.

    python benchmarks/vpipe_vs_exhaustive.py [--instances 200]   (from the repository root)
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.core.strategies import binding_budget, exhaustive
from vpipe_lab.core.errors import InfeasiblePlan
from vpipe_lab.core.planning.planner import search
from vpipe_lab.core.workloads import random_chain


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(0)
    ratios: list[float] = []
    missing = 0
    for seed in range(args.instances):
        n = rng.randint(3, 6)
        k = rng.randint(1, min(3, n))
        m, schedule = rng.choice([2, 4, 8]), rng.choice(["gpipe", "1f1b"])
        profile = random_chain(n, seed=seed)
        cluster = binding_budget(profile, k, m, schedule, rng.uniform(0.2, 1.0))
        best, plan = exhaustive(profile, cluster, m, schedule)
        if math.isinf(best):
            continue
        assert plan is not None
        try:
            found = search(profile, cluster, microbatches=m, schedule=schedule, method="vpipe")
        except InfeasiblePlan:
            missing += 1
            print(f"seed {seed}: vpipe found no plan; exhaustive {plan.describe()}")
            continue
        ratios.append(found.estimate.iteration_s / best)
        if ratios[-1] > 1.02:
            print(f"seed {seed}: {ratios[-1] - 1:+.2%} {found.plan.describe()} | exhaustive {plan.describe()}")
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"{len(ratios) + missing} instances with a plan: vpipe missed {missing}, {sum(r > 1.02 for r in ratios)} "
          f"over 2%, geometric mean {geo - 1:+.3%}, worst {max(ratios) - 1:+.2%}")


if __name__ == "__main__":
    main()
