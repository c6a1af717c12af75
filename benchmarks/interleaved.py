"""vpipe_lab against torch.distributed.pipelining with both jobs alive at once, taking turns in short blocks.

    python benchmarks/interleaved.py [--blocks 12] [--block 8] [--rows 0 1 2 ...]

Why: `vs_pipelining.py` alternates whole runs, seconds to minutes apart, and this machine's compute speed drifts by
+-20% over minutes (the same stage's forward+backward took 50 ms in one minute and 75 ms in the next), so its
ratios spread +-10-15% between rounds. Here one torch.distributed.pipelining job (two spawned ranks that wait on a
pipe between blocks) and one vpipe_lab job (a paused Session) start once, warm up, and then run ``--block``
iterations each in turn, ``--blocks`` rounds, the order rotated every round (the job that runs right after another
refills the caches, so no job may always be the one right after torch): every torch block has a vpipe_lab block
within a second of it. The ratio of each round's pair (torch s/it over vpipe_lab s/it: above 1 means vpipe_lab is
faster) is taken, and the table gives their median and interquartile range.

Schedules: torch's ``Schedule1F1B`` runs ``K - s`` warm-up forwards on stage ``s`` (two on the first of two stages),
which is vpipe_lab's ``eager-1f1b`` (vpipe_lab's ``1f1b`` is the textbook order with ``K - s - 1``, one micro-batch
less in flight), so 1F1B rows run vpipe_lab's eager-1f1b: the same order, the same work. GPipe rows are GPipe on
both. vpipe_lab runs twice per row, with and without fused weight-gradient accumulation (``runtime/wgrad.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import torch.distributed as dist
import torch.multiprocessing as mp
from vs_pipelining import ROWS, WARMUP, _split, free_port, torch_iteration, torch_stage

import vpipe_lab
from vpipe_lab import Plan

T = TypeVar("T")


def _torch_server(rank: int, address: int, name: str, schedule: str, m: int, bounds: tuple[int, ...],
                  conn: Any) -> None:
    """A torch.distributed.pipelining rank that runs the number of iterations it is sent and answers the seconds
    they took (barrier to barrier); None ends it."""
    ex, sched, opt = torch_stage(rank, address, name, schedule, m, bounds)
    it = 0
    while (n := conn.recv()) is not None:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            torch_iteration(rank, ex, sched, opt, it)
            it += 1
        dist.barrier()
        conn.send(time.perf_counter() - start)
    dist.destroy_process_group()


class TorchJob:
    """Two torch.distributed.pipelining ranks kept alive between blocks."""

    def __init__(self, name: str, schedule: str, m: int, bounds: tuple[int, ...]) -> None:
        ctx = mp.get_context("spawn")
        address = free_port()
        self.conns, self.procs = [], []
        for rank in range(2):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_torch_server, args=(rank, address, name, schedule, m, bounds, theirs))
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    def run(self, n: int, timeout: float = 600) -> float:
        """Seconds per iteration over ``n`` iterations (the slower rank's)."""
        for conn in self.conns:
            conn.send(n)
        seconds = []
        for conn in self.conns:
            if not conn.poll(timeout):
                raise RuntimeError(f"torch.distributed.pipelining did not finish {n} iterations in {timeout} s")
            seconds.append(conn.recv())
        return max(seconds) / n

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


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


def _variants(schedule: str) -> list[tuple[str, str, bool]]:
    """(label, vpipe_lab schedule, fused weight gradients): torch's 1F1B order is vpipe_lab's eager-1f1b."""
    same = "eager-1f1b" if schedule == "1f1b" else schedule
    return [("fused", same, True), ("plain", same, False)]


def row(name: str, bounds: tuple[int, ...], schedule: str, m: int, blocks: int, block: int
        ) -> dict[str, list[float]]:
    """Per-block seconds per iteration of torch and of each vpipe_lab variant, blocks interleaved."""
    torch_job = TorchJob(name, schedule, m, bounds)
    sessions = {}
    try:
        for label, sched, fused in _variants(schedule):
            plan = Plan(bounds, ("keep",) * bounds[-1], m, sched)
            s = vpipe_lab.launch(name, stages=2, microbatches=m, schedule=sched, plan=plan, device="cpu",
                                 timeout=300, fused_wgrad=fused)
            s.wait_ready(timeout=300)
            s.run(WARMUP)  # start-up profiling iterations included
            s.wait(timeout=600)
            sessions[label] = s
        torch_job.run(WARMUP)
        times: dict[str, list[float]] = {"torch": [], **{label: [] for label in sessions}}
        runs: list[tuple[str, Callable[[], float]]] = [("torch", partial(torch_job.run, block))]
        runs += [(label, partial(vpipe_block, s, block)) for label, s in sessions.items()]
        for r in range(blocks):
            for label, run in rotated(runs, r):
                times[label].append(run())
        return times
    finally:
        torch_job.close()
        for s in sessions.values():
            s.stop()


def _ratio(torch_s: list[float], ours: list[float]) -> str:
    ratios = sorted(t / v for t, v in zip(torch_s, ours))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return f"{q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--block", type=int, default=8, help="iterations per block")
    ap.add_argument("--rows", type=int, nargs="+", default=list(range(len(ROWS))),
                    help="indices into vs_pipelining.ROWS")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("| model | split | schedule (vpipe_lab's) | M | torch (ms/it) | vpipe_lab (ms/it) | ratio, median (IQR) "
          "| vpipe_lab without fused weight gradients (ms/it) | ratio, median (IQR) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for index in args.rows:
        name, bounds, schedule, m = ROWS[index]
        times = row(name, bounds, schedule, m, args.blocks, args.block)
        cells = [f"{1e3 * statistics.median(times['torch']):.1f}"]
        for label in ("fused", "plain"):
            cells += [f"{1e3 * statistics.median(times[label]):.1f}", _ratio(times["torch"], times[label])]
        ours = _variants(schedule)[0][1]
        print(f"| {name} | {_split(bounds)} | {schedule} ({ours}) | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
