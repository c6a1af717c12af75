"""Data parallelism across pipeline replicas: ``replicas=R`` copies of the S-stage pipeline, R x S ranks.

The ranks form a 2-D ``DeviceMesh`` of shape (replica, stage): global rank ``r * S + s`` is stage ``s`` of replica
``r``, so a pipeline's stages are consecutive ranks. Each replica's first stage reads the global batch and keeps its
``1/R`` share (a contiguous slice along dim 0); after the backward, each stage's gradients are averaged over its
replicas along the mesh's "replica" dimension in one flat all-reduce, which makes every replica's step the step of
one model over the global batch (the losses of R x M micro-batches, each scaled 1/(R M)). Commands are broadcast from
global rank 0 to every rank at the same boundary, so a plan change or a migration happens on every replica at the
same iteration; migration transfers stay inside each replica (``comm.Peer`` addresses stages of its own replica).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from vpipe_lab.runtime.model.batches import batch_size, split


def shard(value: Any, replica: int, replicas: int, what: str) -> Any:
    """Replica ``replica``'s contiguous share of a batch (every tensor split along dim 0). The shares must be equal:
    the replicas' gradients are averaged with equal weights."""
    if replicas == 1 or value is None:
        return value
    size = batch_size(value)
    if size is not None and size % replicas:
        raise ValueError(f"the {what} have batch size {size}, which does not split evenly across {replicas} pipeline "
                         f"replicas (their gradients are averaged with equal weights): use a batch size divisible by "
                         f"{replicas} (drop_last=True in a DataLoader drops a short last batch)")
    return split(value, replicas, what)[replica]


class DataParallel:
    """The gradient average of one stage over its replicas."""

    def __init__(self, device: torch.device, stages: int, replicas: int) -> None:
        self.replicas = replicas
        self.group: Any = None
        if replicas > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (replicas, stages), mesh_dim_names=("replica", "stage"))
            self.group = mesh.get_group("replica")

    def average(self, grads: list[torch.Tensor]) -> None:
        """Average ``grads`` (this stage's, in the same order on every replica) in place, in one all-reduce."""
        if self.replicas == 1 or not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        flat.div_(self.replicas)
        for g, averaged in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(averaged)

