"""vpipe_lab against torch.distributed.pipelining with both jobs alive at once, taking turns in short blocks.

    python benchmarks/interleaved.py [--blocks 12] [--block 8] [--rows 0 1 2 ...]

Why blocks: this machine's compute speed drifts by +-20% over minutes (the same stage's forward+backward took 50 ms
in one minute and 75 ms in the next), so whole runs alternated seconds to minutes apart gave ratios that spread
+-10-15% between rounds. Here one torch.distributed.pipelining job (two spawned ranks that wait on a pipe between
blocks) and the vpipe_lab jobs (paused Sessions) start once, warm up, and then run ``--block`` iterations each in
turn, ``--blocks`` rounds, the order rotated every round (the job that runs right after another refills the caches,
so no job may always be the one right after torch): every torch block has a vpipe_lab block within a second of it.
The ratio of each round's pair (torch s/it over vpipe_lab s/it: above 1 means vpipe_lab is faster) is taken, and the
table gives their median and interquartile range. ``vs_pipelining.py`` measures its tables the same way (``row``);
this script's own table runs vpipe_lab twice per row, with and without fused weight-gradient accumulation
(``runtime/engine/wgrad.py``).

Schedules: 1F1B rows run vpipe_lab's ``eager-1f1b`` (one more warm-up forward per stage than the textbook order)
against torch's ``Schedule1F1B``. That pairing was chosen believing torch's order was the eager one; the export test
(``tests/integration/test_export.py``) since showed torch's ``Schedule1F1B`` runs exactly vpipe_lab's ``1f1b`` when
M >= K. The pairing is kept so the rows recorded in RESULTS.md stay comparable: read them as eager 1F1B against
torch's textbook 1F1B (the same work, one more micro-batch in flight on the lab's side). GPipe rows are GPipe on
both.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from pipelining_job import ROWS, WARMUP, TorchJob, split_label

import vpipe_lab
from vpipe_lab import Plan

T = TypeVar("T")


@dataclass(frozen=True)
class Variant:
    """One vpipe_lab session of a row: its label, schedule, extra ``launch`` options, and whether the online planner
    repartitions it (``Session.replan(apply=True)``, by live migration) before it is timed."""

    label: str
    schedule: str
    options: dict[str, Any] = field(default_factory=dict)
    replan: bool = False
    bounds: tuple[int, ...] | None = None  # its own partition (default: the row's); 2V + 1 of them: V chunks a rank


def same_order(schedule: str) -> str:
    """vpipe_lab's schedule for a torch row (1F1B rows: eager-1f1b; see the module docstring)."""
    return "eager-1f1b" if schedule == "1f1b" else schedule


def rotated(jobs: list[T], r: int) -> list[T]:
    """The jobs in round ``r``'s order: rotated by one each round, so every job runs in every position (the job
    right after a switch of process pays for refilling the caches; in a fixed order that is always the same job)."""
    k = r % len(jobs)
    return jobs[k:] + jobs[:k]


def vpipe_block(session: Any, n: int) -> float:
    """Seconds per iteration of the session's next ``n`` iterations, from their first start to their last end."""
    first = session.iteration
    session.run(n)
    session.wait(timeout=600)
    frame = session.metrics.iterations
    block = frame[frame["iteration"] >= first]
    return float(block["end_s"].max() - block["start_s"].min()) / n


def sessions_in_turn(launches: dict[T, Callable[[], Any]], blocks: int, block: int,
                     warmup: int = 4) -> dict[T, list[float]]:
    """Start every variant's session (each warmed up by ``warmup`` iterations), then run ``blocks`` rounds in which
    each takes ``block`` iterations in turn (``rotated``); seconds per iteration of each block, by variant. Every
    session is stopped, also when one fails to start."""
    sessions: dict[T, Any] = {}
    try:
        for key, start in launches.items():
            s = start()
            s.run(warmup)
            s.wait(timeout=600)
            sessions[key] = s
        times: dict[T, list[float]] = {key: [] for key in sessions}
        for r in range(blocks):
            for key, s in rotated(list(sessions.items()), r):
                times[key].append(vpipe_block(s, block))
        return times
    finally:
        for s in sessions.values():
            s.stop()


def row(name: str, bounds: tuple[int, ...], schedule: str, m: int, blocks: int, block: int,
        variants: list[Variant]) -> tuple[dict[str, list[float]], dict[str, tuple[int, ...]]]:
    """Per-block seconds per iteration of torch (``schedule``) and of each vpipe_lab variant, blocks interleaved;
    and the partition each variant ran."""
    torch_job = TorchJob(name, schedule, m, bounds)
    sessions: dict[str, Any] = {}
    try:
        for v in variants:
            cut = v.bounds or bounds
            virtual = (len(cut) - 1) // 2
            plan = Plan(cut, ("keep",) * cut[-1], m, v.schedule, virtual)
            s = vpipe_lab.launch(name, stages=2, microbatches=m, schedule=v.schedule, plan=plan, device="cpu",
                                 timeout=300, virtual_stages=virtual, **v.options)
            sessions[v.label] = s
            s.wait_ready(timeout=300)
            s.run(WARMUP)  # start-up profiling iterations included
            s.wait(timeout=600)
            if v.replan:
                s.replan(method="vpipe", apply=True)
                s.run(WARMUP)  # the new plan's profiling iterations
                s.wait(timeout=600)
        torch_job.run(WARMUP)
        times: dict[str, list[float]] = {"torch": [], **{label: [] for label in sessions}}
        runs: list[tuple[str, Callable[[], float]]] = [("torch", partial(torch_job.run, block))]
        runs += [(label, partial(vpipe_block, s, block)) for label, s in sessions.items()]
        for r in range(blocks):
            for label, run in rotated(runs, r):
                times[label].append(run())
        return times, {label: tuple(s.plan.boundaries) for label, s in sessions.items()}
    finally:
        torch_job.close()
        for s in sessions.values():
            s.stop()


def ratio(torch_s: list[float], ours: list[float]) -> str:
    """Median (interquartile range) of the blocks' torch s/it over vpipe_lab s/it: above 1, vpipe_lab is faster."""
    ratios = sorted(t / v for t, v in zip(torch_s, ours))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return f"{q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--block", type=int, default=8, help="iterations per block")
    ap.add_argument("--rows", type=int, nargs="+", default=list(range(len(ROWS))),
                    help="indices into pipelining_job.ROWS")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("| model | split | schedule (vpipe_lab's) | M | torch (ms/it) | vpipe_lab (ms/it) | ratio, median (IQR) "
          "| vpipe_lab without fused weight gradients (ms/it) | ratio, median (IQR) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for index in args.rows:
        name, bounds, schedule, m = ROWS[index]
        ours = same_order(schedule)
        variants = [Variant("fused", ours, {"fused_wgrad": True}), Variant("plain", ours, {"fused_wgrad": False})]
        times, _ = row(name, bounds, schedule, m, args.blocks, args.block, variants)
        cells = [f"{1e3 * statistics.median(times['torch']):.1f}"]
        for label in ("fused", "plain"):
            cells += [f"{1e3 * statistics.median(times[label]):.1f}", ratio(times["torch"], times[label])]
        print(f"| {name} | {split_label(bounds)} | {schedule} ({ours}) | {m} | " + " | ".join(cells) + " |",
              flush=True)


if __name__ == "__main__":
    main()
