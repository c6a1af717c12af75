"""Where a worker sits in the job's mesh: its stage, its shard of that stage and its pipeline replica.

Global rank ``r = (replica * shards + shard) * stages + stage``: a pipeline's stages are consecutive ranks, as
before sharding, and each (replica, shard) pair is one data-parallel rank (``dp``) with a pipeline of its own for the
point-to-point transfers, its own share of the batch and its own micro-batches' dropout seeds. The ranks of one stage
that share its parameters through FSDP2 are the ``shards`` ranks of one replica; HSDP replicates across replicas.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    """One worker's place: global ``rank``; ``stage`` of ``stages``; ``shard`` of ``shards``; ``replica`` of
    ``replicas``."""

    rank: int
    stages: int
    shards: int = 1
    replicas: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a job of {self.stages} stages x {self.shards} shards x "
                             f"{self.replicas} replicas ({self.world} ranks)")

    @property
    def world(self) -> int:
        """Every rank of the job."""
        return self.stages * self.shards * self.replicas

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def dp(self) -> int:
        """This rank's data-parallel index: which share of the batch its pipeline runs (replica x shards + shard)."""
        return self.rank // self.stages

    @property
    def dps(self) -> int:
        """Data-parallel ranks: shards x replicas pipelines, each with a share of the batch."""
        return self.shards * self.replicas

    @property
    def shard(self) -> int:
        return self.dp % self.shards

    @property
    def replica(self) -> int:
        return self.dp // self.shards

    def rank_of(self, stage: int, dp: int | None = None) -> int:
        """The global rank of ``stage`` in data-parallel pipeline ``dp`` (this rank's when None)."""
        return (self.dp if dp is None else dp) * self.stages + stage

    def describe(self) -> str:
        """"stage 1", "stage 1 shard 0 of replica 1": how errors and logs name this worker."""
        out = f"stage {self.stage}"
        if self.shards > 1:
            out += f" shard {self.shard}"
        if self.replicas > 1:
            out += f" of replica {self.replica}"
        return out
