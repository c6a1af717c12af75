"""vPipe vs GPipe vs PipeDream, measured: each method's best plan for a fixed global batch, actually trained.

    python benchmarks/paper_table.py [--models mlp gpt-tiny gpt2] [--ranks 2 4] [--budgets 1.0 0.6 0.4]
                                     [--blocks 8] [--block 5]

For each model and rank count: a first run measures the profile (with its throughput-vs-micro-batch-size curve, for
nn.Sequential models) and the cluster; the budget is a fraction of what an even, everything-kept split needs at the
default micro-batch count (the peak of the fullest stage under the cost model). Each method then plans the same global
batch, choosing its micro-batch count within its own rules (``search(..., batch_size=B)``: GPipe recomputes every
layer on an even split, PipeDream keeps every layer on its best split, vPipe searches the partition and per-layer
keep/swap/recompute; GPipe runs its own schedule, PipeDream the paper's (weight stashing, an update after every
micro-batch: ``core/schedules/orders/stashing.py``, its weight copies charged against the budget),
PipeDream-Flush the same planner on 1F1B, vPipe 1F1B). The methods' plans are then launched under that
budget all at once and measured in interleaved blocks (``interleaved.py``: every session alive, ``--block``
iterations each in turn, ``--blocks`` rounds, the order rotated every round), so the machine's drift hits all of them
alike: each cell is the median (interquartile range) over rounds of vPipe's samples/s over the other method's in the
same round. A plan the planner cannot fit is "no fit"; a plan whose measured memory exceeds the budget at run time is
"over budget". The simulator's prediction of every plan (``simulator.period_s``: the replayed iteration plus the
time between iterations) stands next to its measured median twice: from the first run's profile (what the planner
chose with, minutes before the blocks) and from the profile and cluster the plan's own session measured during its
blocks (the online profiler, reset after the warm-up), which the machine's drift between runs cannot move.
All runs: CPU ranks (gloo), one thread each, on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

import torch
from interleaved import rotated, vpipe_block

import vpipe_lab
from vpipe_lab import Plan
from vpipe_lab.control.errors import BudgetError, WorkerError
from vpipe_lab.core.cost import scaling
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.cost.simulator import period_s
from vpipe_lab.core.errors import InfeasiblePlan
from vpipe_lab.core.plan import Policy
from vpipe_lab.core.planning.partition import uniform

WARMUP = 3
METHODS = ("vpipe", "gpipe", "pipedream", "pipedream-flush")
# each method with its own schedule: the paper's PipeDream stashes weights and updates per micro-batch (its planner
# plans that schedule whatever is asked); PipeDream-Flush is its planner on synchronous 1F1B
SCHEDULE = {"vpipe": "1f1b", "gpipe": "gpipe", "pipedream": "pipedream", "pipedream-flush": "1f1b"}


def gpt2() -> torch.nn.Module:
    """A small GPT-2 from transformers (random weights, dropout off), captured with torch.export."""
    import transformers

    from vpipe_lab.runtime.model.compat import allow_torchvision_without_ops

    allow_torchvision_without_ops()
    transformers.logging.set_verbosity_error()
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=64, n_embd=96, n_layer=6, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=False))  # untied for every method: PipeDream cannot keep a tie across stages one weight


def gpt2_data(iteration: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(900 + iteration)
    ids = torch.randint(0, 256, (32, 65), generator=g)
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def job(model: str) -> tuple[dict[str, Any], int]:
    """launch() arguments for a model, and its global batch."""
    if model == "gpt2":
        return {"model": gpt2, "data": gpt2_data,
                "optimizer": lambda ps: torch.optim.AdamW(ps, lr=1e-3)}, 32
    return {"model": model}, 32


def measure(model: str, ranks: int, microbatches: int) -> dict[str, Any]:
    """A first run, everything kept on the even split: its profile and cluster."""
    kwargs, _ = job(model)
    # under a budget no run reaches, so the iterations step after the boundary's agreement as the budgeted runs do
    # (the time between iterations, which the prediction adds, is measured here)
    with vpipe_lab.launch(**kwargs, stages=ranks, microbatches=microbatches, device="cpu", timeout=300,
                          start_timeout=300, memory_budget=1 << 50) as s:
        s.run(WARMUP + 4)
        s.wait(timeout=1800)
        return {"profile": s.profile(), "cluster": s.cluster()}


def table(model: str, ranks: int, budgets: list[float], blocks: int, block: int, m0: int = 4) -> list[dict[str, Any]]:
    _, batch = job(model)
    first = measure(model, ranks, m0)
    profile, cluster = first["profile"], first["cluster"]
    n = len(profile)
    even = estimate(Plan(uniform(n, ranks), (Policy.KEEP,) * n, m0, "1f1b"), profile, cluster)
    need = max(even.peak_bytes)
    rows = []
    for fraction in budgets:
        budget = int(fraction * need)
        # the measured cluster with the budget: its step overhead and swap model too (a Cluster built field by field
        # here once left the runtime's time per step out, and every prediction came out optimistic)
        limited = dataclasses.replace(cluster, memory_bytes=budget, name=f"{ranks} CPU ranks, {fraction:.0%} budget")
        planned: dict[str, dict[str, Any]] = {}
        for method in METHODS:
            row: dict[str, Any] = {"model": model, "ranks": ranks, "budget": fraction, "method": method}
            try:
                found = vpipe_lab.search(profile, limited, batch_size=batch, method=method,
                                         schedule=SCHEDULE[method])
            except InfeasiblePlan:
                row["result"] = "no fit"
            else:
                size = found.microbatch_size or batch // found.plan.microbatches
                row["plan"], row["microbatches"] = found.plan, found.plan.microbatches
                # the replayed iteration and the measured time between iterations: what a block's time per
                # iteration holds (first start to last end)
                row["predicted_s"] = period_s(found.plan, scaling.at(profile, size), limited)
            planned[method] = row
        blocks_of(model, ranks, budget, planned, batch, blocks, block)
        for row in planned.values():
            if "plan" in row:
                row["plan"] = row["plan"].describe()
            rows.append(row)
            print(row, flush=True)
    return rows


def blocks_of(model: str, ranks: int, budget: int, planned: dict[str, dict[str, Any]], batch: int, blocks: int,
              block: int) -> None:
    """Launch every planned method under ``budget`` and time them in interleaved blocks; each row gets its
    per-round seconds per iteration (``blocks_s``), or why it could not run."""
    kwargs, _ = job(model)
    sessions: dict[str, Any] = {}
    try:
        for method, row in planned.items():
            if "plan" not in row:
                continue
            plan = row["plan"]
            try:
                s = vpipe_lab.launch(**kwargs, stages=ranks, microbatches=plan.microbatches, schedule=plan.schedule,
                                     plan=plan, memory_budget=budget, device="cpu", timeout=300, start_timeout=300)
                sessions[method] = s
                s.run(WARMUP)
                s.wait(timeout=600)
                s.profile(reset=True)  # from here the online profiler averages over the timed blocks only
            except (BudgetError, WorkerError) as exc:
                row["result"] = _why(exc)
                sessions.pop(method, None)
        runs: dict[str, list[float]] = {method: [] for method in sessions}
        for r in range(blocks):
            for method in rotated(list(sessions), r):
                if method in runs and planned[method].get("result") is None:
                    try:
                        runs[method].append(vpipe_block(sessions[method], block))
                    except (BudgetError, WorkerError) as exc:
                        planned[method]["result"] = _why(exc)
        for method, times in runs.items():
            row = planned[method]
            if row.get("result") is None and times:
                row["blocks_s"] = times
                row["measured_s"] = statistics.median(times)
                row["samples_per_s"] = batch / row["measured_s"]
                # the same simulator on the profile and cluster this session measured during its own blocks (its
                # micro-batch size, this minute's machine): what a prediction is worth without the drift between a
                # profile run and the blocks, which the first prediction cannot escape
                s = sessions[method]
                row["predicted_in_blocks_s"] = period_s(row["plan"], s.profile(), s.cluster())
    finally:
        for s in sessions.values():
            s.stop()


def _why(exc: Exception) -> str:
    if isinstance(exc, BudgetError):
        return f"over budget at run time (stage {exc.stage})"
    assert isinstance(exc, WorkerError)
    return f"failed: {exc.cause.splitlines()[0][:80]}"


def summary(rows: list[dict[str, Any]]) -> None:
    print("\n| model | ranks | budget | vPipe plan | vPipe samples/s | vs GPipe | vs PipeDream | vs PipeDream-Flush | "
          "predicted (in-block profile)/measured |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    keys = sorted({(r["model"], r["ranks"], r["budget"]) for r in rows}, key=lambda k: (k[0], k[1], -k[2]))
    for key in keys:
        by = {r["method"]: r for r in rows if (r["model"], r["ranks"], r["budget"]) == key}
        v = by.get("vpipe", {})

        def versus(other: str, by: dict[str, dict[str, Any]] = by, v: dict[str, Any] = v) -> str:
            o = by.get(other, {})
            if "blocks_s" not in o:
                return o.get("result", "-")
            if "blocks_s" not in v:
                return "-"
            # the other method's seconds over vPipe's in the same round: vPipe's speed-up, round by round
            ratios = sorted(b / a for a, b in zip(v["blocks_s"], o["blocks_s"]))
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            return f"{q[1]:.2f}x ({q[0]:.2f}-{q[2]:.2f})"

        rate = f"{v['samples_per_s']:.0f}" if "samples_per_s" in v else v.get("result", "-")
        ratio = (f"{v['predicted_in_blocks_s'] / v['measured_s']:.2f}" if "measured_s" in v else "-")
        print(f"| {key[0]} | {key[1]} | {key[2]:.0%} | {v.get('plan', '-')} | {rate} | {versus('gpipe')} | "
              f"{versus('pipedream')} | {versus('pipedream-flush')} | {ratio} |")
    print("\n| model | ranks | budget | method | plan | predicted, first run's profile (ms) | "
          "predicted, in-block profile (ms) | measured (ms) | ratios |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "measured_s" in r:
            first, own, measured = r["predicted_s"], r["predicted_in_blocks_s"], r["measured_s"]
            print(f"| {r['model']} | {r['ranks']} | {r['budget']:.0%} | {r['method']} | {r['plan']} | "
                  f"{first * 1e3:.1f} | {own * 1e3:.1f} | {measured * 1e3:.1f} | "
                  f"{first / measured:.2f} / {own / measured:.2f} |")
    for key, name in (("predicted_s", "first run's profile"), ("predicted_in_blocks_s", "in-block profile")):
        ratios = [r[key] / r["measured_s"] for r in rows if "measured_s" in r]
        if ratios:
            inside = sum(0.9 <= x <= 1.1 for x in ratios)
            print(f"simulator/measured from the {name} over all {len(ratios)} runs: median "
                  f"{statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}, "
                  f"{inside} within 0.9-1.1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt-tiny", "gpt2"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--budgets", nargs="+", type=float, default=[1.0, 0.6, 0.4])
    ap.add_argument("--blocks", type=int, default=8, help="rounds of blocks")
    ap.add_argument("--block", type=int, default=5, help="iterations per block")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for model in args.models:
        for ranks in args.ranks:
            rows += table(model, ranks, args.budgets, args.blocks, args.block)
    summary(rows)


if __name__ == "__main__":
    main()
