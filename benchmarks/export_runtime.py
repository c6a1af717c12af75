"""Exported plans on torch's runtime: each plan's bundle trained by torch.distributed.pipelining, against the lab's
prediction for it, torch's own schedule class on the same split, and both of the lab's engines on the same plan.

    python benchmarks/export_runtime.py [--blocks 8] [--block 5] [--model gpt-tiny] [--rows 0 1 ...]

Per row (a plan of ``--model`` on 2 CPU ranks, M = 8), all alive at once and taking turns in blocks of ``--block``
iterations, the order rotated every round (``interleaved.py`` says why: this machine's speed drifts by +-20% over
minutes, so only blocks seconds apart compare):

- ``lab``: a vpipe_lab session running the plan (``engine="lab"``);
- ``torch engine``: a session running it with ``engine="torch"`` (torch's runtime from the bundle, the lab around it);
- ``bundle (CSV)``: two plain ranks running ``torch_pipeline(model, bundle, rank, use_csv=True)``: the exported
  order through ``_PipelineScheduleRuntime``, nothing of the lab's in the loop;
- ``torch's class``: the same ranks and split under torch's own schedule class for it (``TORCH[schedule].name``;
  where the lab's order is that class's, the two last columns are one order run by two torch runtimes).

``predicted``: the lab's simulator on the profile and cluster the lab's session measured during its blocks
(``simulator.period_s``, what ``paper_table.py`` checks). Ratios are per round (a column's s/it over the lab
engine's in the same round), median and interquartile range.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from interleaved import rotated, vpipe_block

import vpipe_lab
from vpipe_lab import Plan
from vpipe_lab.core.cost.simulator import period_s
from vpipe_lab.core.interop import torch_schedules
from vpipe_lab.examples import get

WARMUP = 3
ROWS = [
    Plan((0, 4, 8), tuple("kkrkkkkk"), 8, "1f1b"),
    Plan((0, 4, 8), tuple("k" * 8), 8, "eager-1f1b"),
    Plan((0, 2, 4, 6, 8), tuple("k" * 8), 8, "interleaved-1f1b", 2),
    Plan((0, 4, 8), tuple("k" * 8), 8, "zb-h1"),
    Plan((0, 2, 4, 6, 8), tuple("k" * 8), 8, "zbv", 2),
]


def _rank(rank: int, port: int, name: str, bundle: str, use_csv: bool, schedule: str | None, conn: Any) -> None:
    """A plain torch.distributed.pipelining rank of the bundle, serving blocks: the seconds ``n`` iterations took."""
    from vpipe_lab.export import torch_pipeline

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    ex = get(name)
    torch.manual_seed(0)
    pp = torch_pipeline(ex.model(), bundle, rank, loss_fn=ex.loss, use_csv=use_csv, schedule=schedule)
    opt = ex.optimizer(pp.parameters())
    it = 0
    while (n := conn.recv()) is not None:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            x, y = ex.data(it)
            pp.step(x, target=y)
            opt.step()
            opt.zero_grad(set_to_none=True)
            it += 1
        dist.barrier()
        conn.send(time.perf_counter() - start)
    dist.destroy_process_group()


class BundleJob:
    """Two plain ranks running a bundle, alive between blocks."""

    def __init__(self, name: str, bundle: Path, use_csv: bool, schedule: str | None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(2):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank, args=(rank, port, name, str(bundle), use_csv, schedule, theirs))
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    def run(self, n: int, timeout: float = 600) -> float:
        for conn in self.conns:
            conn.send(n)
        seconds = []
        for conn in self.conns:
            if not conn.poll(timeout):
                raise RuntimeError(f"the bundle's ranks did not finish {n} iterations in {timeout} s")
            seconds.append(conn.recv())
        return max(seconds) / n

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def ratio(xs: list[float], ref: list[float]) -> str:
    rs = sorted(x / r for x, r in zip(xs, ref))
    q = statistics.quantiles(rs, n=4) if len(rs) > 1 else [rs[0]] * 3
    return f"{q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f})"


def measure(name: str, plan: Plan, blocks: int, block: int, tmp: Path) -> dict[str, Any]:
    """Per-block seconds per iteration of each runner of ``plan``, blocks interleaved; and the prediction."""
    common = dict(stages=2, microbatches=plan.microbatches, schedule=plan.schedule, plan=plan, device="cpu",
                  virtual_stages=plan.virtual_stages, timeout=300)
    sessions = {"lab": vpipe_lab.launch(name, **common), "torch engine": vpipe_lab.launch(name, engine="torch",
                                                                                            **common)}
    jobs: dict[str, BundleJob] = {}
    try:
        bundle = sessions["lab"].export_plan(tmp / f"{plan.schedule}-bundle")
        jobs["bundle (CSV)"] = BundleJob(name, bundle, True, None)
        jobs["torch's class"] = BundleJob(name, bundle, False, torch_schedules.TORCH[plan.schedule].name)
        for s in sessions.values():
            s.run(WARMUP)
            s.wait(timeout=600)
        sessions["lab"].profile(reset=True)  # the prediction below: from what the lab measures in its blocks
        for job in jobs.values():
            job.run(WARMUP)
        runs = [(label, partial(vpipe_block, s, block)) for label, s in sessions.items()]
        runs += [(label, partial(job.run, block)) for label, job in jobs.items()]
        times: dict[str, list[float]] = {label: [] for label, _ in runs}
        for r in range(blocks):
            for label, run in rotated(runs, r):
                times[label].append(run())
        lab = sessions["lab"]
        return {"times": times, "predicted": period_s(plan, lab.profile(), lab.cluster()),
                "exact": torch_schedules.torch_name(plan)}
    finally:
        for job in jobs.values():
            job.close()
        for s in sessions.values():
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block", type=int, default=5, help="iterations per block")
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--rows", type=int, nargs="+", default=list(range(len(ROWS))))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    labels = ["lab", "torch engine", "bundle (CSV)", "torch's class"]
    print(f"{args.model}, 2 ranks, M = 8; ms/it (median of {args.blocks} blocks of {args.block}); ratios: s/it over the "
          "lab engine's in the same round, median (IQR)\n")
    print("| plan | torch class = lab's order | predicted | " + " | ".join(labels) + " | torch engine / lab | "
          "bundle (CSV) / lab | torch's class / lab | lab / predicted |")
    print("|---|---|---|" + "---|" * (len(labels) + 4))
    with tempfile.TemporaryDirectory() as tmp:
        for index in args.rows:
            plan = ROWS[index]
            got = measure(args.model, plan, args.blocks, args.block, Path(tmp))
            t = got["times"]
            cells = [f"{1e3 * statistics.median(t[label]):.1f}" for label in labels]
            lab_s = statistics.median(t["lab"])
            print(f"| `{plan.describe()}` | {got['exact'] or 'no (CSV)'} | {1e3 * got['predicted']:.1f} | "
                  + " | ".join(cells) + " | " + " | ".join(ratio(t[label], t["lab"]) for label in labels[1:])
                  + f" | {lab_s / got['predicted']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
