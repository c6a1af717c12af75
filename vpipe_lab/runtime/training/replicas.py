"""Data parallelism around the pipeline: ``replicas`` copies of it, and ``shards`` ranks per stage that shard it with
FSDP2; stages x shards x replicas ranks (``engine/place.py`` says which is which).

The ranks form one ``DeviceMesh`` of shape (replica, shard, stage). Each data-parallel rank's first stage reads the
global batch and keeps its ``1/(shards x replicas)`` share (a contiguous slice along dim 0). A sharded stage's FSDP
units reduce-scatter their gradients over the "shard" dimension (and all-reduce them over "replica": FSDP's HSDP,
``engine/shards.py``); every gradient FSDP does not hold (a whole stage's when there are no shards, a tie kept whole
on every shard) is averaged here over all the stage's data-parallel ranks in one flat all-reduce. Either way every
rank's step is the step of one model over the global batch (the losses of shards x replicas x M micro-batches, each
scaled 1/M and averaged). Commands are broadcast from global rank 0 to every rank at the same boundary, so a plan
change or a migration happens on every replica and shard at the same iteration; migration transfers stay inside
each data-parallel pipeline (``comm.Peer`` addresses stages of its own), shard k of one stage to shard k of another,
which holds the same slice of every parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from vpipe_lab.runtime.memory.ledger import local_tensor
from vpipe_lab.runtime.model.batches import batch_size, split
from vpipe_lab.runtime.training.place import Place


def shard(value: Any, replica: int, replicas: int, what: str) -> Any:
    """Data-parallel rank ``replica``'s contiguous share of a batch (every tensor split along dim 0) out of
    ``replicas`` (shards x replicas). The shares must be equal: their gradients are averaged with equal weights."""
    if replicas == 1 or value is None:
        return value
    size = batch_size(value)
    if size is not None and size % replicas:
        raise ValueError(f"the {what} have batch size {size}, which does not split evenly across {replicas} "
                         f"data-parallel ranks (shards x replicas; their gradients are averaged with equal weights): "
                         f"use a batch size divisible by {replicas} (drop_last=True in a DataLoader drops a short "
                         "last batch)")
    return split(value, replicas, what)[replica]


class DataParallel:
    """The job's mesh as one stage sees it: the mesh its FSDP units shard over, and the average of its gradients that
    FSDP does not reduce."""

    def __init__(self, device: torch.device, place: Place) -> None:
        self.place = place
        self.replicas = place.dps  # the ranks a whole gradient is averaged over
        self.group: Any = None
        self.shard_mesh: Any = None  # what fully_shard takes: ("shard",), or ("replica", "shard") for HSDP
        self.shard_group: Any = None  # the process group of this stage's shards (its gathers and reduce-scatters)
        if place.dps == 1:
            return
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (place.replicas, place.shards, place.stages),
                                mesh_dim_names=("replica", "shard", "stage"))
        if place.shards > 1:
            self.shard_mesh = mesh["replica", "shard"] if place.replicas > 1 else mesh["shard"]
            self.shard_group = mesh["shard"].get_group()
        # every rank makes every stage's group, in the same order (new_group is collective)
        for stage in range(place.stages):
            group = dist.new_group([place.rank_of(stage, dp) for dp in range(place.dps)])
            if stage == place.stage:
                self.group = group

    def average(self, grads: list[torch.Tensor]) -> None:
        """Average ``grads`` (this stage's whole gradients, in the same order on every data-parallel rank) in place,
        in one all-reduce; FSDP's sharded gradients (DTensors) are left to FSDP, which has reduced them."""
        grads = [g for g in grads if local_tensor(g) is g]
        if self.replicas == 1 or not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        flat.div_(self.replicas)
        for g, averaged in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(averaged)
