"""Throughput of vpipe_lab against torch.distributed.pipelining, side by side in one run (2 CPU ranks, gloo).

    python benchmarks/vs_pipelining.py [--iterations 30] [--rounds 3] [--tables same replanned eager]

Same model, partition (uniform), schedule, micro-batches, optimizer and data; one thread per rank. Both sides are
timed over whole iterations (pipeline, optimizer step and data) from the first timed iteration's start to the last
one's end; the runs alternate (torch, vpipe, torch, vpipe, ...) so machine noise hits both alike, and the ratio
reported is the median over rounds of each round's torch/vpipe ratio (with its range). The "eager" table runs
vpipe_lab's eager 1F1B (one more warm-up forward on the first stage, so transfers overlap compute) against torch's
1F1B on the same model, split, micro-batches, optimizer and data: the same computation, a different order and one
more micro-batch of activations held on the first stage.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vpipe_lab
from vpipe_lab import Plan
from vpipe_lab.examples import get

WARMUP = 3
# (example, partition bounds, schedule, micro-batches): the even splits of the first release's table, then M = 8 on
# uneven splits (the MLP's wide layers sit at its front, so 3/7 balances it better than 5/5).
ROWS = [("gpt-tiny", (0, 4, 8), "1f1b", 4), ("gpt-tiny", (0, 4, 8), "gpipe", 4),
        ("mlp", (0, 5, 10), "1f1b", 4), ("mlp", (0, 5, 10), "gpipe", 4),
        ("mlp", (0, 3, 10), "1f1b", 8), ("gpt-tiny", (0, 3, 8), "1f1b", 8)]
REPLANNED = [("mlp", (0, 5, 10), "1f1b", 8), ("gpt-tiny", (0, 4, 8), "1f1b", 8)]
EAGER = [row for row in ROWS if row[2] == "1f1b"]  # vpipe_lab runs these as eager-1f1b, torch as 1f1b


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torch_stage(rank: int, port: int, name: str, schedule: str, m: int, bounds: tuple[int, ...]
                ) -> tuple[Any, Any, Any]:
    """Join a 2-rank gloo group and build this rank's torch.distributed.pipelining stage: (example, schedule,
    optimizer)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    ex = get(name)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    model = ex.model()
    sub = torch.nn.Sequential(*list(model)[bounds[rank]:bounds[rank + 1]])
    x0, _ = ex.data(0)
    example = torch.chunk(x0, m)[0]
    if rank == 1:  # the second stage's input is the first stage's output
        with torch.no_grad():
            h = torch.chunk(x0, m)[0]
            for layer in list(model)[:bounds[1]]:
                h = layer(h)
        example = h
    stage = PipelineStage(sub, rank, 2, torch.device("cpu"), input_args=example)
    make = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return ex, make(stage, m, loss_fn=ex.loss), ex.optimizer(sub.parameters())


def torch_iteration(rank: int, ex: Any, sched: Any, opt: Any, it: int) -> None:
    """One training iteration of a torch.distributed.pipelining stage: the pipeline, then the optimizer step."""
    x, y = ex.data(it)
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=[])
    opt.step()
    opt.zero_grad(set_to_none=True)


def _torch_rank(rank: int, port: int, name: str, schedule: str, m: int, iterations: int, bounds: tuple[int, ...],
                out: dict) -> None:  # type: ignore[type-arg]
    ex, sched, opt = torch_stage(rank, port, name, schedule, m, bounds)
    dist.barrier()
    start = 0.0
    for it in range(WARMUP + iterations):
        if it == WARMUP:
            dist.barrier()
            start = time.perf_counter()
        torch_iteration(rank, ex, sched, opt, it)
    dist.barrier()
    out[rank] = time.perf_counter() - start
    dist.destroy_process_group()


def torch_pipelining(name: str, schedule: str, m: int, iterations: int, bounds: tuple[int, ...]) -> float:
    """Seconds per iteration of torch.distributed.pipelining."""
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    address = free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, address, name, schedule, m, iterations, bounds, out))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
        if p.is_alive():
            p.kill()
            raise RuntimeError("torch.distributed.pipelining run hung")
    return max(out.values()) / iterations


def vpipe(name: str, schedule: str, m: int, iterations: int, bounds: tuple[int, ...], telemetry: bool = True,
          replan: bool = False) -> tuple[float, tuple[int, ...]]:
    """Seconds per iteration of vpipe_lab, from the first timed iteration's start to the last one's end, and the
    partition it ran. ``replan``: start on ``bounds``, let the online planner repartition from the profile of the
    first iterations (live migration), then time."""
    n = bounds[-1]
    plan = Plan(bounds, ("keep",) * n, m, schedule)
    with vpipe_lab.launch(name, stages=2, microbatches=m, schedule=schedule, plan=plan, device="cpu",
                          telemetry=telemetry, timeout=300) as s:
        first = 0
        if replan:
            s.run(WARMUP)
            s.wait(timeout=600)
            s.replan(method="vpipe", apply=True)
            first = int(s.metrics.iterations["iteration"].max()) + 1
        s.run(WARMUP + iterations)
        s.wait(timeout=1800)
        frame = s.metrics.iterations
        ran = tuple(s.plan.boundaries)
    timed = frame[frame["iteration"] >= first + WARMUP]
    return float(timed["end_s"].max() - timed["start_s"].min()) / iterations, ran


def _split(bounds: tuple[int, ...]) -> str:
    return "/".join(str(b - a) for a, b in itertools.pairwise(bounds))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tables", nargs="+", choices=("same", "replanned", "eager"), default=["same", "replanned", "eager"])
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "same" in args.tables:
        same(args)
    if "replanned" in args.tables:
        replanned(args)
    if "eager" in args.tables:
        eager(args)


def _rounds(args: argparse.Namespace, torch_run: Callable[[], float],
            vpipe_run: Callable[[], tuple[float, tuple[int, ...]]]) -> tuple[float, float, str, tuple[int, ...]]:
    """Alternate torch and vpipe_lab runs for ``args.rounds`` rounds: the median seconds per iteration of each, the
    median (range) of the rounds' throughput ratios (each round's pair ran back to back: its ratio is fairest), and
    the partition vpipe_lab ran last."""
    ts, vs, ran = [], [], ()
    for _ in range(args.rounds):
        ts.append(torch_run())
        v, ran = vpipe_run()
        vs.append(v)
    ratios = sorted(a / b for a, b in zip(ts, vs))
    return (statistics.median(ts), statistics.median(vs),
            f"{statistics.median(ratios):.3f} ({ratios[0]:.2f}-{ratios[-1]:.2f})", ran)


def same(args: argparse.Namespace) -> None:
    print("| model | split | schedule | M | torch.distributed.pipelining (ms/it) | vpipe_lab (ms/it) "
          "| throughput ratio, median (range) of rounds |")
    print("|---|---|---|---|---|---|---|")
    for name, bounds, schedule, m in ROWS:
        t, v, ratio, _ = _rounds(args, partial(torch_pipelining, name, schedule, m, args.iterations, bounds),
                                 partial(vpipe, name, schedule, m, args.iterations, bounds))
        print(f"| {name} | {_split(bounds)} | {schedule} | {m} | {1e3 * t:.1f} | {1e3 * v:.1f} | {ratio} |",
              flush=True)


def replanned(args: argparse.Namespace) -> None:
    print("\nvpipe_lab replanned: it starts on the even split, its online planner repartitions from the first "
          "iterations' profile (applied by live migration), then it is timed; torch.distributed.pipelining runs the "
          "even split, as a user would without a planner.\n")
    print("| model | schedule | M | torch split | torch (ms/it) | vpipe_lab split after replanning "
          "| vpipe_lab (ms/it) | throughput ratio, median (range) of rounds |")
    print("|---|---|---|---|---|---|---|---|")
    for name, bounds, schedule, m in REPLANNED:
        t, v, ratio, ran = _rounds(args, partial(torch_pipelining, name, schedule, m, args.iterations, bounds),
                                   partial(vpipe, name, schedule, m, args.iterations, bounds, replan=True))
        print(f"| {name} | {schedule} | {m} | {_split(bounds)} | {1e3 * t:.1f} | {_split(ran)} | {1e3 * v:.1f} | "
              f"{ratio} |", flush=True)


def eager(args: argparse.Namespace) -> None:
    print("\nvpipe_lab's eager 1F1B against torch.distributed.pipelining's 1F1B (same model, split, M, optimizer, "
          "data):\n")
    print("| model | split | M | torch 1f1b (ms/it) | vpipe_lab eager-1f1b (ms/it) "
          "| throughput ratio, median (range) of rounds |")
    print("|---|---|---|---|---|---|")
    for name, bounds, _, m in EAGER:
        t, v, ratio, _ = _rounds(args, partial(torch_pipelining, name, "1f1b", m, args.iterations, bounds),
                                 partial(vpipe, name, "eager-1f1b", m, args.iterations, bounds))
        print(f"| {name} | {_split(bounds)} | {m} | {1e3 * t:.1f} | {1e3 * v:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
