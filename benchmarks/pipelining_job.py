"""The torch.distributed.pipelining side of the comparisons: the rows, a rank's stage as a user builds it, one
training iteration, and a two-rank job kept alive between blocks of iterations.

Same model, partition, micro-batches, optimizer and data as vpipe_lab's side; gloo on 127.0.0.1, one thread per rank.
"""

from __future__ import annotations

import itertools
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vpipe_lab.core import schedules
from vpipe_lab.examples import get

WARMUP = 3
# (example, partition bounds, schedule, micro-batches): the even splits of the first release's table, then M = 8 on
# uneven splits (the MLP's wide layers sit at its front, so 3/7 balances it better than 5/5).
ROWS = [("gpt-tiny", (0, 4, 8), "1f1b", 4), ("gpt-tiny", (0, 4, 8), "gpipe", 4),
        ("mlp", (0, 5, 10), "1f1b", 4), ("mlp", (0, 5, 10), "gpipe", 4),
        ("mlp", (0, 3, 10), "1f1b", 8), ("gpt-tiny", (0, 3, 8), "1f1b", 8)]
# Rows where vpipe_lab starts on the even split and its online planner may repartition before it is timed.
REPLANNED = [("mlp", (0, 5, 10), "1f1b", 8), ("gpt-tiny", (0, 4, 8), "1f1b", 8)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def split_label(bounds: tuple[int, ...]) -> str:
    """``(0, 3, 10)`` as ``3/7``."""
    return "/".join(str(b - a) for a, b in itertools.pairwise(bounds))


def example_of(name: str) -> Any:
    """A bundled example, or ``hf-gpt2`` (``hf_gpt2.py``: a transformers GPT-2 split into units by hand)."""
    if name == "hf-gpt2":
        import hf_gpt2

        return hf_gpt2
    return get(name)


def torch_stage(rank: int, port: int, name: str, schedule: str, m: int, bounds: tuple[int, ...]
                ) -> tuple[Any, Any, Any]:
    """Join a 2-rank gloo group and build this rank's torch.distributed.pipelining stages: (example, schedule,
    optimizer). ``bounds`` with more than 2 chunks: the rank holds chunks ``rank, rank + 2, ...`` (looped, as
    torch's interleaved schedules and vpipe_lab's virtual stages place them), or under a V schedule (ZBV, DualPipeV)
    chunks ``rank`` and ``3 - rank`` (the V: rank 0 holds the first and the last, and computes the loss). The torch
    class is the one the lab's schedule kind names (``ScheduleKind.torch``: ZB-H1's is torch's ZB1P,
    ``ScheduleInterleavedZeroBubble`` with one stage per rank)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    torch.set_num_threads(1)
    ex = example_of(name)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    layers = list(ex.model())
    chunks = len(bounds) - 1
    x0, _ = ex.data(0)
    stages, params = [], []
    mine = (rank, chunks - 1 - rank) if v_shaped(schedule) else range(rank, chunks, 2)
    for c in mine:
        sub = torch.nn.Sequential(*layers[bounds[c]:bounds[c + 1]])
        with torch.no_grad():  # the chunk's input: the layers before it, on one micro-batch
            example = torch.chunk(x0, m)[0]
            for layer in layers[:bounds[c]]:
                example = layer(example)
        stages.append(PipelineStage(sub, c, chunks, torch.device("cpu"), input_args=example))
        params += list(sub.parameters())
    opt = ex.optimizer(params)
    torch_class = schedules.get(schedule).torch
    assert torch_class is not None, f"torch has no class for {schedule!r}"
    make = get_schedule_class(torch_class.name)
    return ex, make(stages[0] if issubclass(make, PipelineScheduleSingle) else stages, m, loss_fn=ex.loss), opt


def v_shaped(schedule: str) -> bool:
    """Whether torch places the schedule's chunks in a V (rank 0 then holds the last chunk, and the loss)."""
    torch_class = schedules.get(schedule).torch
    return torch_class is not None and torch_class.style == "v"


def torch_iteration(rank: int, ex: Any, sched: Any, opt: Any, it: int, schedule: str = "") -> None:
    """One training iteration of a torch.distributed.pipelining stage: the pipeline, then the optimizer step (under
    a V schedule rank 0 holds the last stage too, so it gives the targets)."""
    x, y = ex.data(it)
    if rank == 0:
        if v_shaped(schedule):
            sched.step(x, target=y, losses=[])
        else:
            sched.step(x)
    elif v_shaped(schedule):
        sched.step()
    else:
        sched.step(target=y, losses=[])
    opt.step()
    opt.zero_grad(set_to_none=True)


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
            torch_iteration(rank, ex, sched, opt, it, schedule)
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
