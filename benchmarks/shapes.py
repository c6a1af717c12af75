"""What taking any shape costs a job whose shapes never change: the same HuggingFace GPT-2 captured with free input
dimensions (the default) and for fixed shapes (``VPIPE_LAB_CAPTURE=static``, what every capture was before), both
jobs alive and taking turns in short blocks (see ``benchmarks/interleaved.py`` for why blocks).

    python benchmarks/shapes.py [--blocks 12] [--block 6]

A graph with symbolic sizes computes them as it runs (``sym_size`` reads, and a later unit reads them again off what
it receives instead of having them sent), and the ranks agree on the micro-batches' shapes once, when training
starts; nothing else differs. The table gives each job's median time per iteration and the median (IQR) of the
per-round ratios (fixed-shape s/it over free-shape s/it: below 1 means free shapes cost something).
"""

from __future__ import annotations

import argparse
import os
import statistics
from functools import partial
from typing import Any

from fused_wgrad import adamw, gpt2, gpt2_data, lm_loss  # the HuggingFace GPT-2 of the fusion benchmark
from interleaved import sessions_in_turn

import vpipe_lab


def launch(static: bool, m: int) -> Any:
    if static:
        os.environ["VPIPE_LAB_CAPTURE"] = "static"  # the workers read it when they capture
    try:
        s = vpipe_lab.launch(gpt2, gpt2_data, loss=lm_loss, optimizer=adamw, stages=2, microbatches=m,
                             schedule="eager-1f1b", device="cpu", timeout=300, start_timeout=300)
    finally:
        os.environ.pop("VPIPE_LAB_CAPTURE", None)
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--block", type=int, default=6, help="iterations per block")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("| model | M | free shapes (ms/it) | fixed shapes (ms/it) | fixed / free, median (IQR) of adjacent blocks |")
    print("|---|---|---|---|---|")
    for m in (4, 8):
        times = sessions_in_turn({static: partial(launch, static, m) for static in (False, True)}, args.blocks,
                                 args.block)
        ratios = sorted(fixed / free for free, fixed in zip(times[False], times[True]))
        q = statistics.quantiles(ratios, n=4)
        print(f"| gpt2-512 (HuggingFace) | {m} | {1e3 * statistics.median(times[False]):.1f} | "
              f"{1e3 * statistics.median(times[True]):.1f} | {q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f}) |", flush=True)


if __name__ == "__main__":
    main()
