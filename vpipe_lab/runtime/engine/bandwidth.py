"""What the planners' Cluster needs from the hardware: this rank's host-copy (swap) bandwidth, its link to the next
rank and that link's latency, measured at start-up."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from vpipe_lab.runtime.engine.comm import TAG_MIGRATE

if TYPE_CHECKING:
    from vpipe_lab.runtime.engine.comm import Peer
    from vpipe_lab.runtime.engine.device import Placement


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
