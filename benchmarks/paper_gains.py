"""The paper's table from the cost model: each method plans the paper's workloads on 8 RTX 2080 Ti for a global batch,
choosing its micro-batch size on the published time-vs-micro-batch curve (``core/workloads.py``'s ``CURVES``).

    python benchmarks/paper_gains.py

GPipe recomputes every layer on an even split; PipeDream (the paper's: weight stashing, its copies of the weights in
the budget) and PipeDream-Flush keep every activation on their best split; vPipe searches the partition and per-layer
keep/swap/recompute. ``search(..., batch_size=B)`` plans every micro-batch count that divides B and keeps the
fastest that fits, so a method that saves memory may run larger micro-batches, which the curve makes faster per
sample: the paper's mechanism. Gains are baseline time / vPipe time - 1, next to the paper's measured ranges.
"""

from __future__ import annotations

from typing import Any

from vpipe_lab.core.errors import InfeasiblePlan
from vpipe_lab.core.planning.planner import search
from vpipe_lab.core.workloads import cluster, workload

METHODS = ("vpipe", "gpipe", "pipedream", "pipedream-flush")
CASES = tuple((name, batch) for name in ("bert-24", "bert-48", "transformer-6-6", "transformer-12-12",
                                         "gpt-cpm-medium", "gpt-cpm-large") for batch in (64, 256))
PAPER = "paper (measured on 2080 Ti): +24.8..291.3% over GPipe, +61.4..463.4% over PipeDream"


def plans(name: str, batch: int, stages: int) -> dict[str, Any]:
    """Each method's plan for the global batch, or None where it fits no micro-batch count."""
    profile = workload(name, microbatch_size=1)
    out: dict[str, Any] = {}
    for method in METHODS:
        try:
            out[method] = search(profile, cluster("rtx2080ti", stages), batch_size=batch, method=method)
        except InfeasiblePlan:
            out[method] = None
    return out


def gain(base: Any, vpipe: Any) -> str:
    if vpipe is None:
        return "vPipe does not fit"
    if base is None:
        return "no fit"
    return f"+{base.estimate.iteration_s / vpipe.estimate.iteration_s - 1:.1%}"


def main() -> None:
    print(f"Cost model, 8 x RTX 2080 Ti, fp32; {PAPER}.\n")
    print("| workload | global batch | micro-batch size: vPipe / GPipe / PipeDream / Flush | vPipe s/it | vs GPipe | "
          "vs PipeDream | vs PipeDream-Flush |")
    print("|---|---|---|---|---|---|---|")
    for name, batch in CASES:
        found = plans(name, batch, 8)
        sizes = " / ".join(str(r.microbatch_size) if r is not None else "-" for r in found.values())
        v = found["vpipe"]
        rate = f"{v.estimate.iteration_s:.2f}" if v is not None else "-"
        print(f"| {name} | {batch} | {sizes} | {rate} | {gain(found['gpipe'], v)} | {gain(found['pipedream'], v)} | "
              f"{gain(found['pipedream-flush'], v)} |", flush=True)


if __name__ == "__main__":
    main()
