"""What counting the experts' load costs: moe-tiny trained with the counting call in its graphs and without
(``VPIPE_LAB_EXPERTS=off``), in alternating blocks on the same machine, and the ratio of their median iteration times.

    python benchmarks/expert_load.py [--stages 2] [--iterations 40] [--rounds 3]

Each round launches both sessions one after the other (counted first, then not, swapped every other round) and takes
the median of each one's iterations after the first five (start-up and profiling iterations). The cost is the ratio
of the medians over all rounds, as a percentage of an iteration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vpipe_lab

WARMUP = 5


def run(counted: bool, stages: int, iterations: int) -> tuple[float, int]:
    """Median iteration seconds after the warm-up, and how many expert rows the session recorded."""
    if counted:
        os.environ.pop("VPIPE_LAB_EXPERTS", None)
    else:
        os.environ["VPIPE_LAB_EXPERTS"] = "off"  # the workers read it when they capture
    try:
        with vpipe_lab.launch("moe-tiny", stages=stages, microbatches=4, device="cpu", timeout=300) as session:
            session.run(iterations)
            session.wait(timeout=900)
            times = list(session.metrics.iterations["time_s"])[WARMUP:]
            rows = len(session.metrics.expert_records())
    finally:
        os.environ.pop("VPIPE_LAB_EXPERTS", None)
    return statistics.median(times), rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    counted, plain = [], []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for on in order:
            median, rows = run(on, args.stages, args.iterations)
            (counted if on else plain).append(median)
            print(f"round {r}: {'counted' if on else 'not counted'}: median iteration {1e3 * median:.1f} ms, "
                  f"{rows} expert rows", flush=True)
            assert (rows > 0) == on, "the switch did not take: counted sessions record rows, the others none"
    a, b = statistics.median(counted), statistics.median(plain)
    print(f"\nmoe-tiny, {args.stages} stages, M=4: counted {1e3 * a:.1f} ms, not counted {1e3 * b:.1f} ms per "
          f"iteration: counting costs {100 * (a / b - 1):+.1f}% of an iteration")


if __name__ == "__main__":
    main()
