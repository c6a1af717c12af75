"""Sharded stages, measured side by side on 4 CPU ranks (gloo, one thread per rank).

    python benchmarks/sharded.py [--blocks 8] [--block 6] [--model mlp] [--tables vs-torch meshes memory]

``vs-torch``: the lab (2 stages x 2 shards, 1F1B, hold: torchtitan's FSDP + PP layout) against a plain script that
composes torch.distributed.pipelining with ``fully_shard`` as torchtitan does (a (pp, dp_shard) mesh, each rank's
stage module sharded with ``reshard_after_forward=False``, ``Schedule1F1B``, torch's stage reducing the gradients at
the last backward): same model, split, micro-batches, optimizer and data. Both jobs stay alive and take turns running
``--block`` iterations, the order rotated each round; the ratio is torch's s/it over the lab's in the same round
(above 1: the lab is faster), median and interquartile range; and each rank's peak memory as the allocator saw it
(the lab's: its meter over a measured iteration; the script's: torch.profiler's memory events over one iteration).

``meshes``: at equal world size (4 ranks) the lab as a pipeline of whole devices (4 stages), 2 stages x 2 shards and
1 stage x 4 shards, each with its best sharding by the planner, timed in turns the same way; and what the cost model
predicted for each, beside it.

``memory`` (asked for by name): each rank's peak as the cost model predicts it against the allocator's meter, for
gpt-tiny, mlp and moe-tiny under each sharding (2 stages x 2 shards, M = 4, after 8 iterations).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from interleaved import ratio, rotated, vpipe_block
from pipelining_job import free_port

import vpipe_lab
from vpipe_lab import Plan
from vpipe_lab.examples import get

STAGES, SHARDS = 2, 2


def _torch_rank(rank: int, port: int, name: str, bounds: tuple[int, ...], m: int, conn: Any) -> None:
    """One rank of the plain script: torch.distributed.pipelining's 1F1B over a stage sharded by fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B

    torch.set_num_threads(1)
    world = STAGES * SHARDS
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    ex = get(name)
    # the lab's layout: a pipeline per data-parallel rank, its stages consecutive ranks
    mesh = init_device_mesh("cpu", (SHARDS, STAGES), mesh_dim_names=("dp_shard", "pp"))
    stage, dp = rank % STAGES, rank // STAGES
    torch.manual_seed(0)
    layers = list(ex.model())
    sub = torch.nn.Sequential(*layers[bounds[stage]:bounds[stage + 1]])
    fully_shard(sub, mesh=mesh["dp_shard"], reshard_after_forward=False)  # torchtitan's default under PP
    x0, _ = ex.data(0)
    share = x0.chunk(SHARDS)[dp]
    with torch.no_grad():
        example = share.chunk(m)[0]
        for layer in layers[:bounds[stage]]:
            example = layer(example)
    del layers  # a user's rank keeps its own stage only (the peak below counts what the process holds)
    import gc

    gc.collect()
    pp = PipelineStage(sub, stage, STAGES, torch.device("cpu"), input_args=example,
                       group=mesh["pp"].get_group())
    sched = Schedule1F1B(pp, m, loss_fn=ex.loss)
    opt = ex.optimizer(sub.parameters())
    it = 0
    while (n := conn.recv()) is not None:
        if n < 0:  # measure one iteration's peak with torch.profiler's memory events, as the lab's CPU meter does
            conn.send(_peak_of(functools.partial(_step, sched, opt, ex, it, stage, dp)))
            it += 1
            continue
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            _step(sched, opt, ex, it, stage, dp)
            it += 1
        dist.barrier()
        conn.send(time.perf_counter() - start)
    dist.destroy_process_group()


def _step(sched: Any, opt: Any, ex: Any, it: int, stage: int, dp: int) -> None:
    x, y = ex.data(it)
    x, y = x.chunk(SHARDS)[dp], y.chunk(SHARDS)[dp]
    if stage == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=[])
    opt.step()
    opt.zero_grad(set_to_none=True)


def _peak_of(run: Any) -> int:
    """What ``run`` added at its most on top of what was held before, plus that (torch.profiler's memory events)."""
    from vpipe_lab.runtime.engine.allocator import timeline

    held = sum(t.numel() * t.element_size() for t in _live_tensors())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    _, sums = timeline(prof.profiler.kineto_results.events())
    return held + max(sums, default=0)


def _live_tensors() -> list[torch.Tensor]:
    import gc

    seen, out = set(), []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            key = local.untyped_storage().data_ptr() if local.numel() else id(local)
            if key not in seen:
                seen.add(key)
                out.append(local)
    return out


class TorchShardedJob:
    """The plain script's 4 ranks, kept alive between blocks."""

    def __init__(self, name: str, bounds: tuple[int, ...], m: int) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(STAGES * SHARDS):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_torch_rank, args=(rank, port, name, bounds, m, theirs))
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    def _ask(self, n: int, timeout: float = 600) -> list[Any]:
        for conn in self.conns:
            conn.send(n)
        out = []
        for conn in self.conns:
            if not conn.poll(timeout):
                raise RuntimeError("the torch ranks did not answer in time")
            out.append(conn.recv())
        return out

    def run(self, n: int) -> float:
        return max(self._ask(n)) / n

    def peaks(self) -> list[int]:
        return [int(p) for p in self._ask(-1)]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def vs_torch(args: argparse.Namespace) -> None:
    name, m = args.model, 4
    n = {"mlp": 10, "gpt-tiny": 8}[name]
    bounds = (0, n // 2, n)
    plan = Plan(bounds, ("keep",) * n, m, "1f1b", shards=SHARDS, sharding=("hold",) * STAGES)
    torch_job = TorchShardedJob(name, bounds, m)
    session = vpipe_lab.launch(name, stages=STAGES, shards=SHARDS, microbatches=m, plan=plan, device="cpu",
                               timeout=300)
    try:
        session.run(6)  # start-up profiling iterations included
        session.wait(timeout=600)
        torch_job.run(3)
        times: dict[str, list[float]] = {"torch": [], "lab": []}
        runs = [("torch", lambda: torch_job.run(args.block)), ("lab", lambda: vpipe_block(session, args.block))]
        for r in range(args.blocks):
            for key, run in rotated(runs, r):
                times[key].append(run())
        torch_peaks = torch_job.peaks()
        memory = session.memory()
    finally:
        session.stop()
        torch_job.close()
    print("| model | mesh | torch + fully_shard (ms/it) | vpipe_lab (ms/it) | throughput ratio, median (IQR) |")
    print("|---|---|---|---|---|")
    print(f"| {name} | {STAGES} stages x {SHARDS} shards, 1F1B, M={m}, hold | "
          f"{1e3 * statistics.median(times['torch']):.1f} | {1e3 * statistics.median(times['lab']):.1f} | "
          f"{ratio(times['torch'], times['lab'])} |")
    print("\n| rank (stage, shard) | torch + fully_shard peak (MiB) | vpipe_lab peak (MiB) | vpipe_lab predicted (MiB) |")
    print("|---|---|---|---|")
    for row in memory.itertuples():
        rank = row.shard * STAGES + row.stage
        lab = row.allocated_peak / 2**20 if row.allocated_peak == row.allocated_peak and row.allocated_peak else None
        print(f"| {row.stage}, {row.shard} | {torch_peaks[rank] / 2**20:.2f} | "
              f"{'-' if lab is None else f'{lab:.2f}'} | {row.predicted_peak / 2**20:.2f} |")


def meshes(args: argparse.Namespace) -> None:
    """4 ranks as 4 x 1, 2 x 2 and 1 x 4 (stages x shards), timed in turns; the planner's prediction beside each."""
    name, m = args.model, 4
    shapes = {"4 stages x 1 shard": (4, 1), "2 stages x 2 shards": (2, 2), "1 stage x 4 shards": (1, 4)}
    sessions: dict[str, Any] = {}
    try:
        for label, (stages, shards) in shapes.items():
            s = vpipe_lab.launch(name, stages=stages, shards=shards, microbatches=m, device="cpu", timeout=300)
            s.run(6)
            s.wait(timeout=600)
            if shards > 1:  # its best sharding by the planner, from the measured profile
                s.replan(apply=True)
                s.run(4)
                s.wait(timeout=600)
            sessions[label] = s
        times: dict[str, list[float]] = {label: [] for label in sessions}
        for r in range(args.blocks):
            for label, s in rotated(list(sessions.items()), r):
                times[label].append(vpipe_block(s, args.block))
        print(f"\n| {name}, 4 ranks | plan | measured (ms/it) | predicted (ms/it) | peak per rank, measured (MiB) |")
        print("|---|---|---|---|---|")
        for label, s in sessions.items():
            predicted = s.replan().current_s
            mem = s.memory()
            peak = mem["allocated_peak"].max()
            print(f"| {label} | {s.plan.describe()[:60]} | {1e3 * statistics.median(times[label]):.1f} | "
                  f"{1e3 * predicted:.1f} | {peak / 2**20:.2f} |")
    finally:
        for s in sessions.values():
            s.stop()


def memory(args: argparse.Namespace) -> None:
    """Each rank's predicted peak against the allocator's, per model and sharding (2 stages x 2 shards, M=4)."""
    print("\n| model | sharding | error per rank: (stage, shard) measured / predicted - 1 |")
    print("|---|---|---|")
    for name in ("gpt-tiny", "mlp", "moe-tiny"):
        for mode in ("hold", "regather", "scatter", "stream"):
            with vpipe_lab.launch(name, stages=STAGES, shards=SHARDS, microbatches=4, device="cpu",
                                  timeout=300) as s:
                s.apply(s.plan.with_mesh(sharding=(mode,) * STAGES))
                s.run(8)
                s.wait(timeout=600)
                rows = s.memory()
            errors = ", ".join(f"({r.stage}, {r.shard}) {r.error:+.1%}" for r in rows.itertuples())
            print(f"| {name} | {mode} | {errors} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--block", type=int, default=6, help="iterations per block")
    ap.add_argument("--model", default="mlp", choices=("mlp", "gpt-tiny"))
    ap.add_argument("--tables", nargs="+", default=["vs-torch", "meshes"],
                    choices=("vs-torch", "meshes", "memory"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "vs-torch" in args.tables:
        vs_torch(args)
    if "meshes" in args.tables:
        meshes(args)
    if "memory" in args.tables:
        memory(args)


if __name__ == "__main__":
    main()
