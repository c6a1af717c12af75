"""Throughput of vpipe_lab against torch.distributed.pipelining on the same work (2 CPU ranks, gloo).

    python benchmarks/vs_pipelining.py [--blocks 16] [--block 8] [--tables same replanned]

Same model, partition, micro-batches, optimizer and data; one thread per rank; the same order of work (torch's
1F1B is vpipe_lab's ``eager-1f1b``, see ``interleaved.py``). Both jobs stay alive and take turns running ``--block``
iterations, the order rotated every round (``interleaved.row``); a block is timed from its first iteration's start
to its last one's end (pipeline, optimizer step and data). The ratio is torch's s/it over vpipe_lab's in the same
round (above 1: vpipe_lab is faster), median and interquartile range over ``--blocks`` rounds.

Tables: ``same`` runs vpipe_lab on torch's partition (``pipelining_job.ROWS``); ``replanned`` starts vpipe_lab on the
even split and lets its online planner repartition from the first iterations' profile (by live migration) before
the blocks, while torch keeps the even split, as a user without a planner would run it.
"""

from __future__ import annotations

import argparse
import os
import statistics

from interleaved import Variant, ratio, row, same_order
from pipelining_job import REPLANNED, ROWS, split_label


def same(args: argparse.Namespace) -> None:
    print("| model | split | schedule (vpipe_lab's) | M | torch.distributed.pipelining (ms/it) | vpipe_lab (ms/it) "
          "| throughput ratio, median (IQR) of blocks |")
    print("|---|---|---|---|---|---|---|")
    for name, bounds, schedule, m in ROWS:
        ours = same_order(schedule)
        times, _ = row(name, bounds, schedule, m, args.blocks, args.block, [Variant("vpipe", ours)])
        print(f"| {name} | {split_label(bounds)} | {schedule} ({ours}) | {m} | "
              f"{1e3 * statistics.median(times['torch']):.1f} | {1e3 * statistics.median(times['vpipe']):.1f} | "
              f"{ratio(times['torch'], times['vpipe'])} |", flush=True)


def replanned(args: argparse.Namespace) -> None:
    print("\nvpipe_lab replanned: it starts on the even split, its online planner repartitions from the first "
          "iterations' profile (applied by live migration), then the blocks run; torch.distributed.pipelining runs "
          "the even split, as a user would without a planner.\n")
    print("| model | schedule (vpipe_lab's) | M | torch split | torch (ms/it) | vpipe_lab split after replanning "
          "| vpipe_lab (ms/it) | throughput ratio, median (IQR) of blocks |")
    print("|---|---|---|---|---|---|---|---|")
    for name, bounds, schedule, m in REPLANNED:
        ours = same_order(schedule)
        times, ran = row(name, bounds, schedule, m, args.blocks, args.block, [Variant("vpipe", ours, replan=True)])
        print(f"| {name} | {schedule} ({ours}) | {m} | {split_label(bounds)} | "
              f"{1e3 * statistics.median(times['torch']):.1f} | {split_label(ran['vpipe'])} | "
              f"{1e3 * statistics.median(times['vpipe']):.1f} | {ratio(times['torch'], times['vpipe'])} |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=16, help="rounds of blocks")
    ap.add_argument("--block", type=int, default=8, help="iterations per block")
    ap.add_argument("--tables", nargs="+", choices=("same", "replanned"), default=["same", "replanned"])
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "same" in args.tables:
        same(args)
    if "replanned" in args.tables:
        replanned(args)


if __name__ == "__main__":
    main()
