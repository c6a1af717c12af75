"""Each stage's peak memory predicted before launch against what the allocator held, across the zoo's families at 2-4
stages under keep, recompute and swap.

    python benchmarks/memory_prediction.py [NAME ...] [--iterations 8]

NAME is a bundled example (gpt-tiny, mlp, moe-tiny) or a zoo model (tests/models/zoo.py); by default one of each
family: a bundled GPT, a decoder LM (llama), an encoder (bert), an encoder-decoder (t5), a vision transformer (vit), a
CNN (resnet18) and a mixture of experts (mixtral). For each: a profiling run (2 stages, the even split, everything
kept, M = 4) gives the profile; from it alone the cost model predicts every stage's peak for the even split at 2, 3 and
4 stages with everything kept, and at 2 stages with the middle layers recomputed and with them swapped; each plan is
then trained and its peak read off the allocator (``metrics.memory``'s ``allocated_peak``: torch.profiler's memory
events on CPU, ``max_memory_allocated`` on CUDA). On CPU a swapped layer's host copy lives in the memory the allocator
counts, so a swap plan is set against its predicted device peak plus its host bytes (as ``Session.memory()`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vpipe_lab
from tests.models.zoo import ZOO
from vpipe_lab import Plan
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.plan import Policy
from vpipe_lab.core.planning.partition import uniform
from vpipe_lab.core.report import human_bytes

FAMILIES = ["gpt-tiny", "llama", "bert", "t5", "vit", "resnet18", "mixtral"]
M = 4


def job(name: str) -> dict[str, Any]:
    """What launch() takes for ``name``: a bundled example by name, a zoo entry by its parts."""
    if name not in ZOO:
        return {"model": name}
    entry = ZOO[name]
    return {"model": entry.model, "data": entry.data, "optimizer": entry.optimizer}


def train(name: str, plan: Plan, iterations: int) -> dict[str, Any]:
    """Train ``plan``: its profile and cluster, and each stage's newest allocator peak."""
    with vpipe_lab.launch(**job(name), plan=plan, device="cpu", timeout=300, start_timeout=600) as s:
        s.run(iterations)
        s.wait(timeout=1200)
        memory = s.metrics.memory
        last = memory[memory["iteration"] == memory["iteration"].max()].sort_values("stage")
        return {"profile": s.profile(), "cluster": s.cluster(), "measured": [int(v) for v in last["allocated_peak"]]}


def plans(layers: int) -> list[tuple[str, Plan]]:
    """The even split at 2, 3 and 4 stages, everything kept; at 2, the middle layers recomputed, and swapped."""
    out = [(f"keep, {k} stages", Plan(uniform(layers, k), ("k",) * layers, M)) for k in (2, 3, 4) if layers >= k]
    middle = ["k"] + ["x"] * (layers - 2) + ["k"]
    for word, policy in (("recompute", "r"), ("swap", "s")):
        out.append((f"{word} the middle layers, 2 stages",
                    Plan(uniform(layers, 2), tuple(policy if p == "x" else p for p in middle), M)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=FAMILIES)
    ap.add_argument("--iterations", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("VPIPE_LAB_PRELOAD", "transformers")
    print("| model | plan | stage | predicted | measured | error |")
    print("|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {}
    for name in args.names:
        probe = _profile(name, args.iterations)
        profile, cluster = probe["profile"], probe["cluster"]
        for what, plan in plans(len(profile.layers)):
            c = dataclasses.replace(cluster, stages=plan.stages)
            est = estimate(plan, profile, c)
            swaps = any(p is Policy.SWAP for p in plan.policies)
            predicted = [p + (h if swaps else 0) for p, h in zip(est.peak_bytes, est.host_bytes)]
            got = train(name, plan, args.iterations)
            for stage, (pred, meas) in enumerate(zip(predicted, got["measured"])):
                err = pred / meas - 1
                errors.setdefault(name, []).append(abs(err))
                print(f"| {name} | {what} | {stage} | {human_bytes(pred)}{' (with host copies)' if swaps else ''} | "
                      f"{human_bytes(meas)} | {100 * err:+.1f}% |", flush=True)
    print()
    for name, errs in errors.items():
        print(f"{name}: largest error {100 * max(errs):.1f}%, median {100 * statistics.median(errs):.1f}% "
              f"({len(errs)} stages)")
    every = [e for errs in errors.values() for e in errs]
    print(f"all: largest {100 * max(every):.1f}%, median {100 * statistics.median(every):.1f}%, "
          f"{sum(e <= 0.10 for e in every)} of {len(every)} within 10%")


def _profile(name: str, iterations: int) -> dict[str, Any]:
    """The profiling run: 2 stages, the workers' own even split, everything kept."""
    with vpipe_lab.launch(**job(name), stages=2, microbatches=M, device="cpu", timeout=300, start_timeout=600) as s:
        s.run(iterations)
        s.wait(timeout=1200)
        return {"profile": s.profile(), "cluster": s.cluster()}


if __name__ == "__main__":
    main()
