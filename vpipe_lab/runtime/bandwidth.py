"""What the planners' Cluster needs from the hardware: this rank's host-copy (swap) bandwidth, its link to the next
rank and that link's latency, measured at start-up."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from vpipe_lab.runtime.comm import TAG_MIGRATE

if TYPE_CHECKING:
    from vpipe_lab.runtime.worker import Worker


def probe_bandwidth(worker: Worker, nbytes: int = 8 << 20) -> dict[str, float]:
    """Measure this rank's host-copy (swap) bandwidth and its link to the next rank, for the planners' Cluster."""
    device = worker.placement.device
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        if worker.placement.is_cuda:
            host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            host.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
        else:
            src.clone()
        times.append(time.perf_counter() - start)
    swap = nbytes / max(min(times), 1e-9)
    link = float("inf")
    if worker.world > 1:
        nxt, prv = (worker.rank + 1) % worker.world, (worker.rank - 1) % worker.world
        best = float("inf")
        for _ in range(2):
            worker.peer.barrier()
            start = time.perf_counter()
            worker.peer.send(src, nxt, TAG_MIGRATE)
            worker.peer.recv(prv, TAG_MIGRATE)
            worker.peer.flush()
            best = min(best, time.perf_counter() - start)
        link = nbytes / max(best, 1e-9)
        # Latency: a stage-boundary transfer is a header and a payload message; time a small one each way.
        tiny = torch.zeros(4, device=device)
        rtts = []
        for _ in range(5):
            worker.peer.barrier()
            start = time.perf_counter()
            # Pairs (0, 1), (2, 3), ...: the even rank pings, the odd one answers; an odd world leaves one out.
            if worker.rank % 2 == 0 and worker.rank + 1 < worker.world:
                worker.peer.send(tiny, worker.rank + 1, TAG_MIGRATE)
                worker.peer.recv(worker.rank + 1, TAG_MIGRATE)
            elif worker.rank % 2 == 1:
                worker.peer.recv(worker.rank - 1, TAG_MIGRATE)
                worker.peer.send(tiny, worker.rank - 1, TAG_MIGRATE)
            worker.peer.flush()
            rtts.append(time.perf_counter() - start)
        latency = min(rtts) if worker.rank + 1 < worker.world or worker.rank % 2 else 0.0  # one transfer each way
        return {"swap_bandwidth": swap, "link_bandwidth": link, "link_latency_s": latency}
    return {"swap_bandwidth": swap, "link_bandwidth": link, "link_latency_s": 0.0}
