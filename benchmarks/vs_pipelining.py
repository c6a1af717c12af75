"""Throughput of vpipe_lab against torch.distributed.pipelining on the same work (2 CPU ranks, gloo).

    python benchmarks/vs_pipelining.py [--blocks 16] [--block 8] [--tables same replanned]

Same model, partition, micro-batches, optimizer and data; one thread per rank; the same order of work (torch's
1F1B is vpipe_lab's ``eager-1f1b``, see ``interleaved.py``). Both jobs stay alive and take turns running ``--block``
iterations, the order rotated every round (``interleaved.row``); a block is timed from its first iteration's start
to its last one's end (pipeline, optimizer step and data). The ratio is torch's s/it over vpipe_lab's in the same
round (above 1: vpipe_lab is faster), median and interquartile range over ``--blocks`` rounds.

Tables: ``same`` runs vpipe_lab on torch's partition (``pipelining_job.ROWS``); ``replanned`` starts vpipe_lab on the
even split and lets its online planner repartition from the first iterations' profile (by live migration) before
the blocks, while torch keeps the even split, as a user without a planner would run it. ``product`` is the product's
own claim: on the same model and global batch, vpipe_lab with its planner choosing the partition, the policies, the
schedule and the micro-batch count (``Session.replan(schedule="auto", choose_microbatches=True, apply=True)``)
against torch.distributed.pipelining as its users run it (the even split, M = 8) under each of its schedules for two
ranks (1F1B, GPipe, and ZB1P, its interleaved zero-bubble schedule with one stage per rank); the ratio is taken
against the torch schedule with the best median, round by round. Models: the uneven MLP and a transformers GPT-2
split into its embeddings, blocks and head (``hf_gpt2.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial
from typing import Any

from interleaved import Variant, ratio, rotated, row, same_order, vpipe_block
from pipelining_job import REPLANNED, ROWS, WARMUP, TorchJob, split_label

PRODUCT = (("mlp", 10), ("hf-gpt2", 8))  # (model, partition units): torch runs the even split
TORCH_SCHEDULES = ("1f1b", "gpipe", "zb-h1")


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


def launch_product(name: str, bounds: tuple[int, ...], m: int) -> Any:
    import vpipe_lab
    from vpipe_lab import Plan

    plan = Plan(bounds, ("keep",) * bounds[-1], m, "1f1b")
    if name == "hf-gpt2":
        import hf_gpt2

        return vpipe_lab.launch(model=hf_gpt2.model, data=hf_gpt2.data, loss=hf_gpt2.loss,
                                optimizer=hf_gpt2.optimizer, stages=2, microbatches=m, plan=plan, device="cpu",
                                timeout=300, start_timeout=300)
    return vpipe_lab.launch(name, stages=2, microbatches=m, plan=plan, device="cpu", timeout=300)


def product(args: argparse.Namespace) -> None:
    print("\nThe product's claim: vpipe_lab planning partition, policies, schedule and micro-batch count itself, against "
          "torch.distributed.pipelining on the even split at M = 8 under each of its two-rank schedules.\n")
    print("| model | torch: best schedule (ms/it) | torch: others (ms/it) | vpipe_lab's plan after replanning | "
          "vpipe_lab (ms/it) | best torch / vpipe_lab, median (IQR) of blocks |")
    print("|---|---|---|---|---|---|")
    for name, units in PRODUCT:
        even, m = (0, units // 2, units), 8
        jobs: dict[str, Any] = {}
        session = None
        try:
            for schedule in TORCH_SCHEDULES:
                jobs[schedule] = TorchJob(name, schedule, m, even)
            session = launch_product(name, even, m)
            session.run(WARMUP)
            session.wait(timeout=600)
            session.replan(method="vpipe", schedule="auto", choose_microbatches=True, apply=True)
            session.run(WARMUP)  # the new plan's profiling iterations
            session.wait(timeout=600)
            for job in jobs.values():
                job.run(WARMUP)
            runs: list[tuple[str, Any]] = [(s, partial(job.run, args.block)) for s, job in jobs.items()]
            runs.append(("vpipe", partial(vpipe_block, session, args.block)))
            times: dict[str, list[float]] = {label: [] for label, _ in runs}
            for r in range(args.blocks):
                for label, run in rotated(runs, r):
                    times[label].append(run())
            best = min(TORCH_SCHEDULES, key=lambda s: statistics.median(times[s]))
            others = ", ".join(f"{s} {1e3 * statistics.median(times[s]):.1f}" for s in TORCH_SCHEDULES if s != best)
            print(f"| {name} | {best} {1e3 * statistics.median(times[best]):.1f} | {others} | "
                  f"{session.plan.describe()} | {1e3 * statistics.median(times['vpipe']):.1f} | "
                  f"{ratio(times[best], times['vpipe'])} |", flush=True)
        finally:
            for job in jobs.values():
                job.close()
            if session is not None:
                session.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=16, help="rounds of blocks")
    ap.add_argument("--block", type=int, default=8, help="iterations per block")
    ap.add_argument("--tables", nargs="+", choices=("same", "replanned", "product"),
                    default=["same", "replanned", "product"])
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "same" in args.tables:
        same(args)
    if "replanned" in args.tables:
        replanned(args)
    if "product" in args.tables:
        product(args)


if __name__ == "__main__":
    main()
