"""What watching for a NaN or infinite loss costs: ``nonfinite="pause"`` (the default) against ``"continue"``, the
two jobs alive at once and taking turns in short blocks.

    python benchmarks/nonfinite.py [--blocks 10] [--block 6]

Under "pause" (and "skip") every stage waits for the boundary's all-reduce before its optimizer step, so a stage
whose backward ends early no longer steps while stage 0 runs its last backward; under "continue" without a memory
budget it does. Jobs: gpt-tiny on 2 CPU stages (1F1B, M = 4) and the bundled MLP on 2 stages (M = 8); the ratio is
per adjacent pair of blocks (see ``benchmarks/interleaved.py`` for why blocks, not whole runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial
from typing import Any

from interleaved import sessions_in_turn

import vpipe_lab

JOBS: dict[str, dict[str, Any]] = {
    "gpt-tiny, 2 stages, 1F1B, M=4": {"model": "gpt-tiny", "microbatches": 4},
    "mlp, 2 stages, 1F1B, M=8": {"model": "mlp", "microbatches": 8},
}


def compare(job: dict[str, Any], blocks: int, block: int) -> dict[str, list[float]]:
    return sessions_in_turn({mode: partial(vpipe_lab.launch, job["model"], stages=2, microbatches=job["microbatches"],
                                           device="cpu", timeout=300, start_timeout=300, nonfinite=mode)
                             for mode in ("pause", "continue")}, blocks, block)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--block", type=int, default=6, help="iterations per block")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("| job | pause (ms/it) | continue (ms/it) | pause / continue, median (IQR) of adjacent blocks |")
    print("|---|---|---|---|")
    for name, job in JOBS.items():
        times = compare(job, args.blocks, args.block)
        ratios = sorted(p / c for p, c in zip(times["pause"], times["continue"]))
        q = statistics.quantiles(ratios, n=4)
        print(f"| {name} | {1e3 * statistics.median(times['pause']):.1f} | "
              f"{1e3 * statistics.median(times['continue']):.1f} | {q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f}) |", flush=True)


if __name__ == "__main__":
    main()
