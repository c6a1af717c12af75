"""Live layer migration: pause against bytes moved and against stop/checkpoint/restart; NAS; automatic replanning.

    python benchmarks/migration.py

1. A 2-stage pipeline of wide layers (2048 x 2048 Linear + ReLU, SGD with momentum: 33.6 MB of parameters and
   optimizer state per layer) moves 1, 2 and 4 layers between stages. Pause = the longest rank's time at the
   boundary (checkpoint off, so it is the migration alone); physical limit = bytes / measured link bandwidth.
2. The same partition change made by stopping, checkpointing and restarting the job with the new plan.
3. NAS: time from set_model (a block inserted on the heavy stage) to a rebalanced pipeline (profile 2 iterations,
   replan, migrate).
4. Throughput on the uneven MLP: automatic replanning against staying on the initial uniform plan.
All on 2 CPU ranks (gloo, loopback).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

import vpipe_lab
from vpipe_lab import Plan
from vpipe_lab.examples import mlp

WIDTH, DEPTH = 2048, 8


def wide() -> torch.nn.Sequential:
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())
                                 for _ in range(DEPTH)])


def wide_data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(iteration)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)  # type: ignore[arg-type]


def launch_wide(**kw: object) -> vpipe_lab.Session:
    return vpipe_lab.launch(wide, wide_data, stages=2, microbatches=4, optimizer=sgd, device="cpu", timeout=300,
                            **kw)  # type: ignore[arg-type]


def pause_of(session: vpipe_lab.Session, version: int) -> float:
    spans = [sp for sp in session.metrics.timeline() if sp.kind == "migrate"]
    # Spans of one migration share its iteration; the last ones recorded belong to the newest version.
    it = session.last_migration["iteration"]  # type: ignore[index]
    return max(sp.duration_s for sp in spans if sp.iteration == it)


def part_migration() -> None:
    print("## Migration pause against bytes moved\n")
    print("| layers moved | bytes moved | pause (ms) | bytes / link bandwidth (ms) | pause / limit | "
          "stop + checkpoint + restart (ms) | restart / pause |")
    print("|---|---|---|---|---|---|---|")
    base = (0, 4, 8)
    for n in (1, 2, 3):
        pauses = []
        with launch_wide() as s:
            s.run(2)
            s.wait(timeout=600)
            link = s.cluster().link_bandwidth
            moved = 0
            for rep in range(3):
                target = (0, 4 - n, 8) if rep % 2 == 0 else base
                s.set_partition(target, checkpoint=False)
                pauses.append(pause_of(s, s.plan_version))
                moved = s.last_migration["moved_bytes"]  # type: ignore[index]
            s.run(1)
            s.wait(timeout=600)
            with tempfile.TemporaryDirectory() as tmp:
                # The same change the old way: checkpoint, stop the job, start it again on the new plan.
                start = time.perf_counter()
                path = s.save(Path(tmp) / "ckpt")
                s.stop()
                plan = Plan((0, 4 - n, 8), ("keep",) * DEPTH, 4, "1f1b")
                with launch_wide(resume=path, plan=plan):
                    restart = time.perf_counter() - start
        pause = statistics.median(pauses)
        limit = moved / link
        print(f"| {n} | {moved / 2**20:.1f} MiB | {1e3 * pause:.1f} | {1e3 * limit:.1f} | {pause / limit:.2f} | "
              f"{1e3 * restart:.0f} | {restart / pause:.0f}x |", flush=True)


def bigger_mlp() -> torch.nn.Sequential:
    blocks = list(mlp.model())
    return torch.nn.Sequential(*blocks[:2], torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()),
                               *blocks[2:])


def part_nas() -> None:
    print("\n## Time from a NAS change to a rebalanced pipeline (uneven MLP, a block inserted on the heavy stage)\n")
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=300) as s:
        s.run(3)
        s.wait(timeout=300)
        t0 = time.perf_counter()
        at = s.set_model(bigger_mlp)  # the default even split puts the new block on the heavy stage
        t1 = time.perf_counter()
        s.run(2)
        s.wait(timeout=300)
        t2 = time.perf_counter()
        found = s.replan(apply=True)
        t3 = time.perf_counter()
        s.run(5)
        s.wait(timeout=300)
        frame = s.metrics.iterations
        before = float(frame[(frame["iteration"] >= at) & (frame["iteration"] < at + 2)]["time_s"].median())
        after = float(frame[frame["iteration"] >= found.applied_at + 1]["time_s"].median())  # type: ignore[operator]
    print("| set_model | profile (2 iterations) | replan + migrate | total | iteration before -> after |")
    print("|---|---|---|---|---|")
    print(f"| {1e3 * (t1 - t0):.0f} ms | {1e3 * (t2 - t1):.0f} ms | {1e3 * (t3 - t2):.0f} ms | "
          f"{1e3 * (t3 - t0):.0f} ms | {1e3 * before:.1f} -> {1e3 * after:.1f} ms ({s.plan.describe()}) |", flush=True)


def part_auto(rounds: int = 2, iterations: int = 40) -> None:
    print("\n## Automatic replanning against the initial uniform plan (uneven MLP, 2 stages, M = 4)\n")
    print("| run | uniform (samples/s) | auto-replanned (samples/s) | gain | plan reached |")
    print("|---|---|---|---|---|")
    for r in range(rounds):
        rates = {}
        reached = ""
        for auto in (False, True):
            with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=300,
                                  auto_replan={"every": 5, "horizon": 100} if auto else False) as s:
                s.run(iterations)
                s.wait(timeout=600)
                frame = s.metrics.iterations
                rates[auto] = float(frame["samples_per_s"].iloc[-iterations // 2:].median())
                if auto:
                    reached = s.plan.describe()
        print(f"| {r + 1} | {rates[False]:.0f} | {rates[True]:.0f} | {rates[True] / rates[False] - 1:+.1%} | "
              f"{reached} |", flush=True)


if __name__ == "__main__":
    part_migration()
    part_nas()
    part_auto()
