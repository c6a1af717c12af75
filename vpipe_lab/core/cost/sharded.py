"""What sharding a stage over K ranks (FSDP2: ``runtime/engine/shards.py``) does to one rank's memory and time.

A rank holds ``1/K`` of its stage's parameters, gradients and optimizer state (a tied parameter whole: FSDP leaves it
to the stages that hold it). While it computes it also holds whole parameters and whole gradients, as its
``Sharding`` says (``core/sharding.py``), with U the largest unit's parameters, P and G the stage's (ties aside):

    hold      whole P + G (gathered at the first forward, gradients accumulating to the last backward);
              at the end as much (each unit resharded before its reduce-scatter's input is made); its sharded
              gradients (G / K, counted with the static bytes, as the optimizer step holds them) are not made
              until that reduce, nor under regather
    regather  whole G and one unit gathered (U), then that unit's reduce-scatter input (U)
    scatter   whole P, one unit's gradients with their reduce-scatter input (2 U); under a split backward (B, then
              W) a micro-batch's W leaves the chunk's G whole until its reduce
    stream    one unit gathered and its gradients (2 U), their reduce-scatter input made once the unit is
              resharded; split: U and the chunk's G

and it spends, over the shard link (``Cluster.shard_bandwidth``, else the stages' link), an all-gather and a
reduce-scatter of ``bytes (K - 1) / K`` each and a latency per unit (HSDP adds the replicas' all-reduce of the
shards; replicas of whole stages all-reduce their gradients once per iteration): once per iteration (hold: both;
regather: the reduce; scatter: the gather), or per micro-batch (regather and
stream gather before each forward and each backward; scatter and stream reduce after each backward). The once per
iteration collectives delay the iteration as a whole (``once_s``): the gather the first forward, the reduce the step.
The runtime runs them on the compute stream (the gathers are not prefetched), so they add to its time.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from vpipe_lab.core.cost.stage_cost import RangeMax
from vpipe_lab.core.profile import Cluster, SharedTensor
from vpipe_lab.core.sharding import Sharding


@dataclass(frozen=True)
class ShardCost:
    """What FSDP adds to one rank of a sharded stage (layers lo:hi): its static bytes (its shards, ties whole), what
    it holds whole on top of the activations while it computes (``whole_bytes``) and at the iteration's end
    (``end_bytes``, the activations gone), and the collectives' seconds per micro-batch and per iteration."""

    static_bytes: int
    whole_bytes: int = 0
    end_bytes: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    once_s: float = 0.0


class ShardModel:
    """Per-rank costs of sharded stages for one profile (prefix sums: O(1) per stage, as the planners ask)."""

    def __init__(self, param_bytes: Sequence[int], shared: Sequence[SharedTensor], cluster: Cluster, shards: int,
                 replicas: int = 1) -> None:
        self.shards, self.replicas = shards, replicas
        self._pp = [0, *accumulate(param_bytes)]
        self._unit = RangeMax(list(param_bytes))
        self.shared = tuple(shared)
        self.bandwidth = cluster.shard_bandwidth or cluster.link_bandwidth
        self.latency = cluster.link_latency_s

    def ties(self, lo: int, hi: int) -> tuple[int, int]:
        """(static bytes, parameter bytes) of the tied tensors layers lo:hi use, each once: kept whole."""
        static = params = 0
        for tensor in self.shared:
            if bisect_left(tensor.units, hi) > bisect_left(tensor.units, lo):
                static, params = static + tensor.static_bytes, params + tensor.param_bytes
        return static, params

    def collective_s(self, nbytes: int, units: int) -> float:
        """One all-gather (or reduce-scatter) of ``nbytes`` whole over the shards, a collective per unit; with
        replicas, the reduce's all-reduce of the shards across them rides on the same link."""
        k = self.shards
        return units * self.latency + nbytes * (k - 1) / k / self.bandwidth

    def reduce_s(self, nbytes: int, units: int) -> float:
        """A reduce-scatter over the shards, and with replicas the all-reduce of the shards across them."""
        r = self.replicas
        extra = units * self.latency + 2 * (r - 1) / r * (nbytes / self.shards) / self.bandwidth if r > 1 else 0.0
        return self.collective_s(nbytes, units) + extra

    def static(self, lo: int, hi: int, static: int) -> int:
        """One rank's share of layers lo:hi's ``static`` bytes (unsharded, ties once): a shard, ties whole."""
        tie_static, _ = self.ties(lo, hi)
        return (static - tie_static) // self.shards + tie_static

    def cost(self, lo: int, hi: int, static: int, params: int, sharding: Sharding, split: bool) -> ShardCost:
        """Layers lo:hi on one rank, given their ``static`` and ``params`` bytes unsharded (ties once)."""
        mine = self.static(lo, hi, static)
        whole = params - self.ties(lo, hi)[1]  # P, and G as large
        unit, units = self._unit(lo, hi), hi - lo
        if self.shards == 1:  # whole stages in replicas: each stage's gradients all-reduced once per iteration
            return ShardCost(mine, once_s=self.reduce_s(whole, units) - self.collective_s(whole, units))
        gather, reduce = self.collective_s(whole, units), self.reduce_s(whole, units)
        # the sharded gradients (counted static, as the optimizer step holds them) are made by the first reduce:
        # a stage that reduces once per iteration computes without them
        unmade = whole // self.shards
        if sharding is Sharding.HOLD:
            # at its end reduce a unit's parameters are freed before its reduce-scatter's input is made: no U more
            return ShardCost(mine, 2 * whole - unmade, 2 * whole - unmade, once_s=gather + reduce)
        if sharding is Sharding.REGATHER:  # the gradients whole, one unit gathered (then its reduce-scatter input)
            return ShardCost(mine, whole + unit - unmade, whole + unit - unmade, gather, gather, once_s=reduce)
        held = whole if split else unit  # a split backward's W leaves the chunk's gradients whole until reduced
        if sharding is Sharding.SCATTER:  # the parameters whole, a unit's gradients and their reduce-scatter input
            return ShardCost(mine, whole + held + unit, whole, 0.0, reduce, once_s=gather)
        # stream: a unit gathered, its gradients, their reduce-scatter input once the unit is resharded
        return ShardCost(mine, unit + held, 0, gather, gather + reduce)
