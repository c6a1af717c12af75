"""The newer schedules against torch.distributed.pipelining's on the same work (2 CPU ranks), and the planner's pick.

    python benchmarks/schedules.py [--blocks 10] [--block 6] [--tables torch planner] [--schedules zbv dualpipev]

``torch``: per row (model, split, M, schedule), one torch.distributed.pipelining job running that schedule -- ZB-H1 is
torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank (its ZB1P), interleaved 1F1B its
``ScheduleInterleaved1F1B`` with the row's chunks in looped placement, ZBV its ``ScheduleZBVZeroBubble`` with the
chunks in V placement (rank 0: chunks 0 and 3), DualPipeV its ``ScheduleDualPipeV`` on the same V (its overlapped
forward-backward pairs run one after the other on CPU) -- and vpipe_lab sessions running the same
schedule on the same chunks, plus vpipe_lab's 1F1B on the matching two-stage split for reference; all alive at once,
taking turns in blocks of ``--block`` iterations, the order rotated every round (``interleaved.row``). Each cell: the
job's ms/it (median of blocks) and the ratio of torch's same-schedule job over it in the same round (above 1: faster
than torch), median and interquartile range.

``planner``: per model, vpipe_lab profiles a 1F1B session, asks ``Session.replan(schedule="auto")`` (every schedule
and V = 2..4 charged its memory and the measured overhead per step), and then every candidate runs in interleaved
blocks on the planner's partition; the table gives each one's ms/it and says whether the planner's pick is within 5%
of the fastest.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics

from interleaved import Variant, ratio, row
from pipelining_job import split_label, v_shaped

# (model, chunk bounds, M, schedule): ZB-H1 on one chunk per rank, interleaved and ZBV on two. (ZBV's MLP split
# gives rank 0 the wide first layers and the narrow last ones: 2 + 4 layers against 1 + 3.)
ROWS = [("mlp", (0, 3, 10), 8, "zb-h1"), ("mlp", (0, 3, 10), 4, "zb-h1"), ("gpt-tiny", (0, 4, 8), 8, "zb-h1"),
        ("mlp", (0, 2, 3, 6, 10), 8, "interleaved-1f1b"), ("gpt-tiny", (0, 2, 4, 6, 8), 8, "interleaved-1f1b"),
        ("gpt-tiny", (0, 2, 4, 6, 8), 4, "interleaved-1f1b"), ("mlp", (0, 2, 3, 6, 10), 8, "zbv"),
        ("gpt-tiny", (0, 2, 4, 6, 8), 8, "zbv"), ("gpt-tiny", (0, 2, 4, 6, 8), 4, "zbv"),
        ("mlp", (0, 2, 3, 6, 10), 8, "dualpipev"), ("gpt-tiny", (0, 2, 4, 6, 8), 8, "dualpipev"),
        ("gpt-tiny", (0, 2, 4, 6, 8), 4, "dualpipev")]


def two_stage(bounds: tuple[int, ...], schedule: str = "") -> tuple[int, ...]:
    """The one-chunk-per-rank split closest to a looped (or ZBV's V) one: rank 0's layers first."""
    ranks = (0, 1, 1, 0) if v_shaped(schedule) else (0, 1) * ((len(bounds) - 1) // 2)
    first = sum(b - a for c, (a, b) in enumerate(itertools.pairwise(bounds)) if ranks[c] == 0)
    return (0, first, bounds[-1])


def against_torch(args: argparse.Namespace) -> None:
    print("| model | chunks | M | schedule | torch (ms/it) | vpipe_lab (ms/it) | torch / vpipe_lab, median (IQR) "
          "| vpipe_lab 1f1b on the 2-stage split (ms/it) | torch / vpipe_lab 1f1b |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, bounds, m, schedule in ROWS:
        if args.schedules and schedule not in args.schedules:
            continue
        variants = [Variant("same", schedule), Variant("1f1b", "1f1b", bounds=two_stage(bounds, schedule))]
        times, _ = row(name, bounds, schedule, m, args.blocks, args.block, variants)
        print(f"| {name} | {split_label(bounds)} | {m} | {schedule} | {1e3 * statistics.median(times['torch']):.1f} | "
              f"{1e3 * statistics.median(times['same']):.1f} | {ratio(times['torch'], times['same'])} | "
              f"{1e3 * statistics.median(times['1f1b']):.1f} | {ratio(times['torch'], times['1f1b'])} |", flush=True)


def planner(args: argparse.Namespace) -> None:
    import vpipe_lab

    print("\n| model | M | planner's pick (predicted ms/it) | candidate | predicted ms/it | measured ms/it (median of "
          "blocks) |")
    print("|---|---|---|---|---|---|")
    for name, m in (("mlp", 8), ("gpt-tiny", 8)):
        with vpipe_lab.launch(name, stages=2, microbatches=m, device="cpu", timeout=300) as s:
            s.run(6)
            s.wait(timeout=600)
            chosen = s.replan(schedule="auto")
            profile, cluster = chosen.profile, s.cluster()
        from vpipe_lab.core.planning.planner import search

        found = search(profile, cluster, microbatches=m, schedule="auto")
        candidates = [label for label, t in found.schedules if t is not None and not label.startswith("gpipe")]
        variants = []
        for label in candidates:
            schedule, _, v = label.partition(" V=")
            plan = search(profile, cluster, microbatches=m, schedule=schedule, virtual_stages=int(v or 1)).plan
            variants.append(Variant(label, schedule, bounds=plan.boundaries))
        times, _ = row(name, variants[0].bounds or (), "1f1b", m, args.blocks, args.block, variants)
        best = min(statistics.median(times[v.label]) for v in variants)
        pick = chosen.plan.schedule + (f" V={chosen.plan.virtual_stages}" if chosen.plan.virtual_stages > 1 else "")
        for v in variants:
            t = statistics.median(times[v.label])
            mark = " (pick" + (", within 5% of the fastest)" if t <= 1.05 * best else ", NOT within 5%)") \
                if v.label == pick else ""
            predicted = dict(found.schedules)[v.label] or float("nan")
            print(f"| {name} | {m} | {pick} ({1e3 * chosen.predicted_s:.1f}) | {v.label}{mark} | {1e3 * predicted:.1f} "
                  f"| {1e3 * t:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=10, help="rounds of blocks")
    ap.add_argument("--block", type=int, default=6, help="iterations per block")
    ap.add_argument("--tables", nargs="+", choices=("torch", "planner"), default=["torch", "planner"])
    ap.add_argument("--schedules", nargs="+", help="only the torch table's rows of these schedules")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in args.tables:
        against_torch(args)
    if "planner" in args.tables:
        planner(args)


if __name__ == "__main__":
    main()
