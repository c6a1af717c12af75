"""A bundle of sharded stages on torch.distributed.pipelining, composed with FSDP2 the way torchtitan does it.

The job's ranks form a (replica, shard, stage) ``DeviceMesh``, as the lab's (``runtime/training/place.py``): a rank's
stage is ``rank % stages`` and its data-parallel index ``rank // stages``; the ranks of one data-parallel index are a
pipeline of their own (their "stage" group carries torch's stage-to-stage transfers), and each stage's module is
``fully_shard``-ed over the "shard" dimension (with replicas, over ("replica", "shard"): HSDP), resharding after its
forward as the plan's sharding of that stage says. torch's pipeline stages then drive FSDP themselves: they keep the
gradients whole over the micro-batches and reduce-scatter them once, at the iteration's last backward
(``_PipelineStage.perform_reduce_grad``), as torchtitan's PP + FSDP runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vpipe_lab.core.plan import Plan
from vpipe_lab.runtime.memory.ledger import local_tensor
from vpipe_lab.runtime.training.place import Place
from vpipe_lab.runtime.training.replicas import shard


@dataclass(frozen=True)
class Mesh:
    """This rank's place in a sharded bundle's job: its ``place``, the group of its pipeline's stages (None: the
    whole job is one pipeline) and the mesh its stages' modules are sharded over (None: not sharded)."""

    place: Place
    pipeline_group: Any = None
    shard_mesh: Any = None
    replica_mesh: Any = None  # replicas of whole stages: torch's ``replicate`` averages their gradients

    @property
    def stage(self) -> int:
        return self.place.stage

    def share(self, value: Any, what: str) -> Any:
        """This rank's data-parallel share of a global batch (contiguous along dim 0), as the lab's ranks take it."""
        return shard(value, self.place.dp, self.place.dps, what)


def mesh_of(plan: Plan, rank: int, world: int, device: torch.device) -> Mesh:
    """The mesh of ``plan`` (collective: every rank of the job calls it); ``world`` must be its stages x shards x
    replicas."""
    if world != plan.devices:
        raise ValueError(f"the bundle's plan runs on {plan.devices} ranks ({plan.stages} stages x {plan.shards} shards "
                         f"x {plan.replicas} replicas) but the process group has {world}: start {plan.devices} ranks "
                         f"(torchrun --nproc-per-node {plan.devices})")
    place = Place(rank, plan.stages, plan.shards, plan.replicas)
    if place.dps == 1:
        return Mesh(place)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (plan.replicas, plan.shards, plan.stages),
                            mesh_dim_names=("replica", "shard", "stage"))
    shards = None
    if plan.shards > 1:
        shards = mesh["replica", "shard"] if plan.replicas > 1 else mesh["shard"]
    return Mesh(place, mesh["stage"].get_group(), shards, mesh["replica"] if plan.shards == 1 else None)


def shard_module(module: nn.Module, mesh: Mesh, plan: Plan) -> nn.Module:
    """``fully_shard`` one stage's module over the shard mesh, resharding after its forward as the plan's sharding
    of this stage says (torchtitan's ``fsdp_reshard_after_forward``); the module itself when not sharded."""
    if mesh.shard_mesh is None:
        if mesh.replica_mesh is not None:  # whole stages in replicas: torch's DDP on FSDP2, which its stages drive
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(module, mesh=mesh.replica_mesh)
        return module
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh.shard_mesh,
                reshard_after_forward=plan.sharding_of(mesh.stage).reshard_after_forward)
    return module


def whole_state(modules: list[nn.Module], name: Any) -> dict[str, torch.Tensor]:
    """The modules' parameters and buffers whole, under ``name(key)`` (a sharded stage's gathered: collective over
    its shards, which all call this together)."""
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        for key, t in module.state_dict(keep_vars=False).items():
            whole = t.full_tensor() if hasattr(t, "full_tensor") else t
            out.setdefault(name(key), whole)
    return out


def tie_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each copy's gradient as this rank holds it (a sharded one's shard: the copies on the stages that tie a weight
    are sharded alike, so their shards sum rank by rank)."""
    return [local_tensor(p.grad) for p in params if p.grad is not None]
