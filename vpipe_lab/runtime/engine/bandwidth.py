"""What the planners' Cluster needs from the hardware: this rank's host-copy (swap) bandwidth, its link to the next
rank and that link's latency, and the user's optimizer step and a weight copy per byte, measured at start-up."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vpipe_lab.runtime.engine.comm import TAG_MIGRATE

if TYPE_CHECKING:
    from vpipe_lab.runtime.engine.comm import Peer
    from vpipe_lab.runtime.engine.device import Placement

log = logging.getLogger(__name__)


def probe_update(factory: Callable[[Any], torch.optim.Optimizer] | None, placement: Placement,
                 like: Sequence[torch.Tensor] = (), nbytes: int = 8 << 20) -> dict[str, float]:
    """Seconds per parameter byte of the user's optimizer step and of a fresh copy of the weights (what PipeDream
    pays after every micro-batch), timed on throwaway parameters shaped like ``like`` (the stage's own, up to
    ``nbytes``, so the per-tensor costs of many small weights count as they will), else one of ``nbytes``: the best
    of three after one step that builds the optimizer's state."""
    device = placement.device
    shapes: list[tuple[torch.Size, torch.dtype]] = []
    total = 0
    for t in like:
        if total >= nbytes:
            break
        shapes.append((t.shape, t.dtype))
        total += t.numel() * t.element_size()
    if not total:
        shapes, total = [(torch.Size([nbytes // 4]), torch.float32)], nbytes
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) for shape, dtype in shapes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)

    def best(run: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            if placement.is_cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times) / total

    copy = best(lambda: [p.data.clone() for p in params])
    if factory is None:
        return {"update_s_per_byte": 0.0, "copy_s_per_byte": copy}
    try:
        optimizer = factory(params)
        optimizer.step()
    except Exception as exc:  # a factory that wants its model's own parameters: PipeDream's update stays uncharged
        log.info("the optimizer step could not be timed on test parameters (%s: %s)", type(exc).__name__, exc)
        return {"update_s_per_byte": 0.0, "copy_s_per_byte": copy}
    return {"update_s_per_byte": best(optimizer.step), "copy_s_per_byte": copy}


def probe_bandwidth(peer: Peer, placement: Placement, rank: int, world: int, nbytes: int = 8 << 20) -> dict[str, float]:
    """Measure this rank's host-copy (swap) bandwidth and its link to the next rank, for the planners' Cluster."""
    device = placement.device
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    # On CPU a swap is a copy on the compute thread into memory the allocator has handed out before: time a copy
    # into a buffer allocated once (a fresh 8 MiB clone each time also timed the kernel faulting its pages in, 3-8x
    # slower than the copy itself on this machine).
    dst = None if placement.is_cuda else torch.empty_like(src).fill_(0.0)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        if placement.is_cuda:
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            host.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
        else:
            assert dst is not None
            dst.copy_(src)
        times.append(time.perf_counter() - start)
    swap = nbytes / max(min(times), 1e-9)
    link = float("inf")
    if world > 1:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        best = float("inf")
        for _ in range(2):
            peer.barrier()
            start = time.perf_counter()
            peer.send(src, nxt, TAG_MIGRATE)
            peer.recv(prv, TAG_MIGRATE)
            peer.flush()
            best = min(best, time.perf_counter() - start)
        link = nbytes / max(best, 1e-9)
        # Latency: a stage-boundary transfer is a header and a payload message; time a small one each way.
        tiny = torch.zeros(4, device=device)
        rtts = []
        for _ in range(5):
            peer.barrier()
            start = time.perf_counter()
            # Pairs (0, 1), (2, 3), ...: the even rank pings, the odd one answers; an odd world leaves one out.
            if rank % 2 == 0 and rank + 1 < world:
                peer.send(tiny, rank + 1, TAG_MIGRATE)
                peer.recv(rank + 1, TAG_MIGRATE)
            elif rank % 2 == 1:
                peer.recv(rank - 1, TAG_MIGRATE)
                peer.send(tiny, rank - 1, TAG_MIGRATE)
            peer.flush()
            rtts.append(time.perf_counter() - start)
        latency = min(rtts) if rank + 1 < world or rank % 2 else 0.0  # one transfer each way
        return {"swap_bandwidth": swap, "link_bandwidth": link, "link_latency_s": latency}
    return {"swap_bandwidth": swap, "link_bandwidth": link, "link_latency_s": 0.0}


def probe_shards(group: Any, shards: int, placement: Placement, nbytes: int = 8 << 20) -> dict[str, float]:
    """A sharded stage's collective bandwidth, as FSDP2 spends it: an all-gather of ``nbytes`` whole over its
    ``shards`` ranks and a reduce-scatter of as much (``all_gather_into_tensor``, ``reduce_scatter_tensor``: gloo
    reduces through an all-reduce, so its reduce-scatter costs more than the gather), each the best of three; the
    bandwidth that prices the pair as the cost model charges each (``b (K - 1) / K / shard_bandwidth``). Every shard
    of the stage calls it together."""
    import torch.distributed as dist

    whole = torch.ones(max(shards, nbytes // 4 // shards * shards), dtype=torch.float32, device=placement.device)
    part = torch.empty(whole.numel() // shards, dtype=torch.float32, device=placement.device)

    def best(run: Callable[[], Any]) -> float:
        times = []
        for _ in range(3):
            dist.barrier(group=group)
            start = time.perf_counter()
            run()
            if placement.is_cuda:
                torch.cuda.synchronize(placement.device)
            times.append(time.perf_counter() - start)
        return min(times)

    gather = best(lambda: dist.all_gather_into_tensor(whole, part, group=group))
    reduce = best(lambda: dist.reduce_scatter_tensor(part, whole, group=group))
    moved = whole.numel() * 4 * (shards - 1) / shards
    return {"shard_bandwidth": 2 * moved / max(gather + reduce, 1e-9)}
