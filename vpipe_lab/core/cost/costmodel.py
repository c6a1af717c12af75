"""The cost model: per-stage time and each rank's peak memory of a plan, and the pipeline's iteration time.

The arithmetic is docs/cost_model.md's: time per micro-batch from the profile's layers, their transfers, recompute and
exposed swaps; peak memory from the static tensors (a sharded stage's shards: ``sharded.py``), the activations in
flight as each schedule holds them, the largest working set or rebuild on top, what the transfers hold and what a
sharded stage holds whole; the iteration from each schedule's closed form (``core/schedules/pipeline_time.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from vpipe_lab.core import checks, schedules
from vpipe_lab.core.cost.sharded import ShardCost, ShardModel
from vpipe_lab.core.cost.shared_bytes import SharedBytes
from vpipe_lab.core.cost.stage_cost import (
    Held,
    RangeMax,
    StageCost,
    chunks_peak,
    estimate_of,
    policy_overhead,
    stage_peak,
    swap_buffers,
    transfers_peak,
    walk,
)
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Estimate, Plan, Policy
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.core.schedules.orders.held import Transfers
from vpipe_lab.core.sharding import Sharding

__all__ = ["CostModel", "RangeMax", "StageCost", "chunks_peak", "estimate", "policy_overhead", "swap_buffers"]


class CostModel:
    """Prefix sums over a profile for O(1) stage queries; the single source of costs for planners and estimates."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, microbatches: int, schedule: str = "1f1b",
                 virtual_stages: int = 1, shards: int = 1, sharding: Sequence[Sharding] = (),
                 replicas: int = 1) -> None:
        self.kind = schedules.get(schedule)  # what the schedule's name means: its costs are asked of it
        checks.count(microbatches, "microbatches", error=PlanError)
        self.profile = profile
        self.cluster = cluster
        self.microbatches = microbatches
        self.schedule = schedule
        self.stages = cluster.stages
        # Interleaved: stage-level queries below take a chunk (virtual stage) where they say "stage"; chunk c runs on
        # stage c % stages. Without virtual stages the two are the same.
        self.virtual = virtual_stages
        self.chunks = self.stages * virtual_stages
        self.placement = self.kind.placement(self.stages, self.chunks)  # the stage of each chunk
        self.backward_steps = 2 if self.kind.split_backward else 1  # B and W steps, or one backward
        layers = profile.layers
        self.num_layers = len(layers)
        self.fwd = [x.forward_s for x in layers]
        self.bwd = [x.backward_s for x in layers]
        self._pw = [0.0, *accumulate(x.wgrad_s for x in layers)]
        # what a micro-batch waiting for its weight step keeps: the inputs and output gradients of the GEMMs
        self._pwait = [0, *accumulate(min(x.activation_bytes, x.input_bytes + x.output_bytes) if x.param_bytes else 0
                                      for x in layers)]
        self.act = [x.activation_bytes for x in layers]
        self.inp = [x.input_bytes for x in layers]
        self.out = [x.output_bytes for x in layers]
        self._pf = [0.0, *accumulate(self.fwd)]
        self._pb = [0.0, *accumulate(self.bwd)]
        self.compute_prefix = [0.0, *accumulate(f + b for f, b in zip(self.fwd, self.bwd))]
        self._pa = [0, *accumulate(self.act)]
        self._ps = [0, *accumulate(x.static_bytes for x in layers)]
        self._pp = [0, *accumulate(x.param_bytes for x in layers)]
        self._shared = SharedBytes(profile.shared)  # a tied parameter is counted by each unit; a stage holds it once
        self.trans = [x.transient_bytes for x in layers]
        self._trans_max = RangeMax(self.trans)
        # a kept stage's largest working set on top of its own micro-batch's layers so far: max (P[i+1] + trans[i])
        self._kept_top = RangeMax([self._pa[i + 1] + t for i, t in enumerate(self.trans)])
        self._keep = (Policy.KEEP,) * len(layers)
        self._step_max = RangeMax([x.step_bytes for x in layers])
        self.total_compute_s = self.compute_prefix[-1]
        self.shards, self.sharding, self.replicas = shards, tuple(sharding), replicas  # sharded stages: sharded.py
        self._sharded = ShardModel([x.param_bytes for x in layers], profile.shared, cluster, shards, replicas) \
            if shards > 1 or replicas > 1 else None

    @classmethod
    def of(cls, plan: Plan, profile: ModelProfile, cluster: Cluster) -> CostModel:
        """The cost model of ``plan``'s schedule, micro-batches, chunks and mesh."""
        return cls(profile, cluster, *cls._key(plan))

    def plan(self, bounds: Sequence[int], policies: Sequence[Policy]) -> Plan:
        """A plan of this model's schedule, micro-batches, chunks and mesh over ``bounds`` with ``policies``."""
        return Plan(tuple(bounds), tuple(policies), self.microbatches, self.schedule, self.virtual, self.shards,
                    self.replicas, self.sharding)

    @staticmethod
    def _key(plan: Plan) -> tuple[int, str, int, int, tuple[Sharding, ...], int]:
        return plan.microbatches, plan.schedule, plan.virtual_stages, plan.shards, plan.sharding, plan.replicas

    def shard_cost(self, stage: int, lo: int, hi: int) -> ShardCost | None:
        """What sharding adds to one rank of ``stage`` (a chunk, with virtual stages) over lo:hi; None: not sharded."""
        if self._sharded is None:
            return None
        mode = self.sharding[self.placement[stage]] if self.sharding else Sharding.HOLD
        return self._sharded.cost(lo, hi, self._whole_static(lo, hi), self.param_bytes(lo, hi), mode,
                                  self.kind.split_backward)

    # --- O(1) stage queries -------------------------------------------------------------------------------------
    def inflight(self, stage: int) -> int:
        """Micro-batches whose activations a stage (a chunk, with virtual stages) holds at its peak."""
        return int(self.kind.inflight(self.stages, stage, self.microbatches, self.virtual))

    def held(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """What ``rank`` holds along a chunked schedule's order (``core/schedules/orders/held.py``); empty for the others."""
        return tuple(self.kind.held(self.stages, self.virtual, self.microbatches, rank))

    def budget(self, stage: int) -> int:
        return self.cluster.budgets[stage]

    def compute_s(self, lo: int, hi: int) -> float:
        """Forward plus backward compute of layers lo:hi: a lower bound on the stage's time, monotone in the range."""
        return self.compute_prefix[hi] - self.compute_prefix[lo]

    def forward_compute_s(self, lo: int, hi: int) -> float:
        return self._pf[hi] - self._pf[lo]

    def backward_compute_s(self, lo: int, hi: int) -> float:
        return self._pb[hi] - self._pb[lo]

    def waiting_bytes(self, stage: int, lo: int, hi: int) -> int:
        """ZB-H1: what the micro-batches beyond ``inflight`` that wait only for their weight step hold (else 0; ZBV
        counts its waiting micro-batches per chunk: ``StageCost.wait_bytes``)."""
        waiting = self.kind.waiting_w(self.stages, stage, self.microbatches)
        if waiting <= 0:
            return 0
        return (waiting - self.inflight(stage)) * (self._pwait[hi] - self._pwait[lo])

    def wgrad_compute_s(self, lo: int, hi: int) -> float:
        """The weights' gradients' part of layers lo:hi's backward (``LayerCost.wgrad_s``)."""
        return self._pw[hi] - self._pw[lo]

    def _whole_static(self, lo: int, hi: int) -> int:
        return self._ps[hi] - self._ps[lo] - self._shared.extra(lo, hi)[0]

    def static_bytes(self, lo: int, hi: int) -> int:
        """Parameters, gradients and optimizer state of layers lo:hi on one rank (a tie once; sharded: its shard)."""
        whole = self._whole_static(lo, hi)
        return whole if self._sharded is None else self._sharded.static(lo, hi, whole)

    def param_bytes(self, lo: int, hi: int) -> int:
        return self._pp[hi] - self._pp[lo] - self._shared.extra(lo, hi)[1]

    def stash_bytes(self, stage: int, lo: int, hi: int) -> int:
        """PipeDream: the copies of layers lo:hi's weights ``stage`` keeps for forwards in flight (else 0)."""
        versions = self.kind.stashed_versions(self.stages, stage, self.microbatches)
        return versions * self.param_bytes(lo, hi) if versions else 0

    def activation_sum(self, lo: int, hi: int) -> int:
        return self._pa[hi] - self._pa[lo]

    def wait_bytes(self, lo: int, hi: int) -> int:
        """Per micro-batch, what layers lo:hi hold between B and W (the GEMMs' inputs and output gradients)."""
        return self._pwait[hi] - self._pwait[lo]

    def local(self, chunk: int) -> bool:
        """Whether ``chunk`` hands its output to the next chunk on its own stage (ZBV's turn): no transfer."""
        return chunk + 1 < self.chunks and self.placement[chunk] == self.placement[chunk + 1]

    def send_forward_s(self, stage: int, hi: int) -> float:
        """The sender's time for a stage's output: the link's latency and its bytes over the link bandwidth. The
        latency is charged twice, to the sender and as the transfer's flight (``hop_s``): on gloo it is mostly
        software time on both ends (per transfer, so V chunks per stage pay it V times), and the receiver waits for
        it (which 1F1B's round trips expose and eager 1F1B hides)."""
        if stage >= self.chunks - 1 or self.local(stage):
            return 0.0
        return self.cluster.link_latency_s + self.out[hi - 1] / self.cluster.link_bandwidth

    def send_backward_s(self, stage: int, lo: int) -> float:
        if stage <= 0 or self.local(stage - 1):
            return 0.0
        return self.cluster.link_latency_s + self.inp[lo] / self.cluster.link_bandwidth

    @property
    def hop_s(self) -> float:
        """A transfer's flight: from its send's end to its arrival, on nobody's compute stream."""
        return self.cluster.link_latency_s

    def boundary_bytes(self, stage: int, lo: int, hi: int) -> int:
        """Bytes a stage sends and receives per micro-batch (activations both ways, gradients both ways)."""
        total = 0
        if stage > 0 and not self.local(stage - 1):
            total += 2 * self.inp[lo]
        if stage < self.chunks - 1 and not self.local(stage):
            total += 2 * self.out[hi - 1]
        return total

    def hide_s(self, stage: int, lo: int, hi: int) -> float:
        """Compute time per micro-batch under which swap transfers can hide (none where copies run on the compute
        thread: ``Cluster.swap_overlaps``)."""
        if not self.cluster.swap_overlaps:
            return 0.0
        hide = self.compute_s(lo, hi)
        if self.cluster.shared_link:
            hide -= self.boundary_bytes(stage, lo, hi) / self.cluster.swap_bandwidth
        return max(0.0, hide)

    def keep_all_bytes(self, stage: int, lo: int, hi: int) -> int:
        """Peak memory of the stage with every layer kept (held activations, largest working set on top; or the step;
        sharded: what FSDP holds whole on top, ``sharded.py``)."""
        shard = self.shard_cost(stage, lo, hi) or ShardCost(0)
        whole, end = shard.whole_bytes, shard.end_bytes
        return (self.static_bytes(lo, hi) + self.stash_bytes(stage, lo, hi)
                + max(self.inflight(stage) * self.activation_sum(lo, hi) + self.waiting_bytes(stage, lo, hi)
                      + self.batch_bytes(stage) + self._trans_max(lo, hi) + self.comm_bytes(stage, lo, hi) + whole,
                      self._step_max(lo, hi), end))

    def _walk(self, stage: int, lo: int, hi: int, policies: Sequence[Policy]) -> Held:
        made = (lambda i: self.param_bytes(lo, i + 1)) if self.credits_gradients(stage) else None
        return walk(lo, hi, policies, self.act, self.inp, self.trans, self.fwd, made)

    def peak_bytes(self, stage: int, lo: int, hi: int, policies: Sequence[Policy]) -> int:
        """``stage_cost(...).peak_bytes`` alone (the memory planners ask it of every choice they try)."""
        n, held = self.inflight(stage), self._walk(stage, lo, hi, policies)
        shard = self.shard_cost(stage, lo, hi) or ShardCost(0)
        return stage_peak(self.static_bytes(lo, hi) + self.stash_bytes(stage, lo, hi),
                          n * held.resident + self.waiting_bytes(stage, lo, hi) + self.batch_bytes(stage),
                          swap_buffers(n) * held.swapped, held.rebuilt, self.comm_bytes(stage, lo, hi),
                          shard.whole_bytes, self._step_max(lo, hi), shard.end_bytes)

    def keep_peak_bytes(self, stage: int, lo: int, hi: int) -> int:
        """The estimate's peak of layers lo:hi with every layer kept (``stage_cost(...).peak_bytes``, in O(1) but where
        the gradients' credit walks the layers): whether a kept stage fits, by the numbers the user is shown."""
        if self.credits_gradients(stage):
            return self.stage_cost(stage, lo, hi, self._keep).peak_bytes
        shard = self.shard_cost(stage, lo, hi) or ShardCost(0)
        rebuilt = max(0, self._kept_top(lo, hi) - self._pa[hi])  # the top over the stage's own micro-batch whole
        activations = (self.inflight(stage) * self.activation_sum(lo, hi) + self.waiting_bytes(stage, lo, hi)
                       + self.batch_bytes(stage))
        return (self.static_bytes(lo, hi) + self.stash_bytes(stage, lo, hi)
                + max(activations + rebuilt + self.comm_bytes(stage, lo, hi) + shard.whole_bytes,
                      self._step_max(lo, hi), shard.end_bytes))

    def credits_gradients(self, stage: int) -> bool:
        """Every forward of the stage comes before its first backward, which makes the gradients (counted static)
        layer by layer: its peak may come before some are made (``stage_cost``)."""
        return (self.inflight(stage) == self.microbatches and self.chunks == self.stages and self.shards == 1
                and not (self.kind.split_backward or self.kind.asynchronous))

    def batch_bytes(self, stage: int) -> int:
        """Stage 0 reads the whole batch before its iteration and holds it to the end: besides the inputs of the
        micro-batches in flight (its first layer's saved input, or a recomputed one's kept input), the others'."""
        return 0 if stage or self.chunks != self.stages else (self.microbatches - self.inflight(0)) * self.inp[0]

    def comm_bytes(self, stage: int, lo: int, hi: int) -> int:
        """The most the stage's transfers hold at once along its order (``StageCost.comm_bytes``), whatever the
        activations' policies."""
        return transfers_peak(self._transfers(stage), *self._sent_bytes(stage, lo, hi))

    def _sent_bytes(self, stage: int, lo: int, hi: int) -> tuple[int, int]:  # an input gradient, an output
        return self.inp[lo] if stage > 0 else 0, self.out[hi - 1] if stage < self.chunks - 1 else 0

    def _transfers(self, stage: int) -> tuple[Transfers, ...]:
        return () if self.chunks != self.stages else self.kind.transfers(self.stages, self.microbatches, stage)

    def planned_peak_bytes(self, stage: int, lo: int, hi: int, policies: Sequence[Policy]) -> int:
        """The stage's peak as the memory planners count it (``core/planning/memory_plans.py``): the largest working
        set, or recomputed layer's rebuild with its own, on top of every micro-batch in flight whole, and every swapped
        layer's input kept as if each began a run. Never less than ``stage_cost``'s peak (which credits the rest); the
        planners are exact under this bound, and every plan they find fits by the estimate too."""
        cost = self.stage_cost(stage, lo, hi, policies)
        top = max((self.act[i] if policies[i] is Policy.RECOMPUTE else 0) + self.trans[i] for i in range(lo, hi))
        n, runs = cost.inflight, sum(min(self.inp[i], self.act[i]) for i in range(lo + 1, hi)
                                     if policies[i] is Policy.SWAP and policies[i - 1] is Policy.SWAP)
        return cost.static_bytes + max(cost.activation_bytes + cost.swap_buffer_bytes + top + cost.comm_bytes
                                       + (n - swap_buffers(n)) * runs + cost.whole_bytes, cost.step_bytes,
                                       cost.end_bytes)

    def step_peak_bytes(self, stage: int, lo: int, hi: int) -> int:
        """The stage's memory during its optimizer step (and a sharded stage's end-of-iteration reduce), which no
        activation policy lowers."""
        shard = self.shard_cost(stage, lo, hi) or ShardCost(0)
        return self.static_bytes(lo, hi) + self.stash_bytes(stage, lo, hi) + max(self._step_max(lo, hi), shard.end_bytes)

    def update_s(self, stage: int, lo: int, hi: int) -> float:
        """PipeDream: per micro-batch, the optimizer's step on layers lo:hi's weights and their share of the copies
        that move the live weights off memory forwards in flight still read (else 0)."""
        if not self.kind.asynchronous:
            return 0.0
        share = self.kind.weight_copies(self.stages, stage, self.microbatches) / self.microbatches
        return self.param_bytes(lo, hi) * (self.cluster.update_s_per_byte + share * self.cluster.copy_s_per_byte)

    def base_times(self, stage: int, lo: int, hi: int) -> tuple[float, float]:
        """Forward and backward time per micro-batch with every layer kept (communication and the runtime's
        overhead per step included: one for the forward, one for the backward and one for a split-off weight step;
        under PipeDream the update after each backward)."""
        step = self.cluster.step_overhead_s
        shard = self.shard_cost(stage, lo, hi) or ShardCost(0)  # a sharded stage's collectives per micro-batch
        return (self.forward_compute_s(lo, hi) + self.send_forward_s(stage, hi) + step + shard.forward_s,
                self.backward_compute_s(lo, hi) + self.send_backward_s(stage, lo) + step * self.backward_steps
                + self.update_s(stage, lo, hi) + shard.backward_s)

    # --- full evaluation ----------------------------------------------------------------------------------------
    def stage_cost(self, stage: int, lo: int, hi: int, policies: Sequence[Policy]) -> StageCost:
        """Cost of layers lo:hi on ``stage`` with ``policies`` (indexed by global layer)."""
        n = self.inflight(stage)
        held = self._walk(stage, lo, hi, policies)
        resident, swapped, moved, recompute, rebuilt = held
        shard = self.shard_cost(stage, lo, hi)  # sharded: its gradients are counted whole on top, not static
        extra = policy_overhead(recompute, moved, self.hide_s(stage, lo, hi), self.cluster.swap_bandwidth,
                                self.cluster.swap_overlaps)
        fwd, bwd = self.base_times(stage, lo, hi)
        sent = self._sent_bytes(stage, lo, hi)
        return StageCost(
            forward_s=fwd,
            backward_s=bwd + extra,
            recompute_s=recompute,
            swap_exposed_s=extra - recompute,
            comm_s=self.send_forward_s(stage, hi) + self.send_backward_s(stage, lo),
            static_bytes=self.static_bytes(lo, hi) + self.stash_bytes(stage, lo, hi),
            activation_bytes=n * resident + self.waiting_bytes(stage, lo, hi) + self.batch_bytes(stage),
            swap_buffer_bytes=swap_buffers(n) * swapped,
            host_bytes=(n - swap_buffers(n)) * swapped,
            inflight=n,
            rebuild_bytes=rebuilt,
            wgrad_s=self.wgrad_compute_s(lo, hi),
            resident_bytes=resident,
            wait_bytes=self.wait_bytes(lo, hi) if self.kind.split_backward else 0,
            transient_bytes=self._trans_max(lo, hi),
            step_bytes=self._step_max(lo, hi),
            transfers=self._transfers(stage), sent_in_bytes=sent[0], sent_out_bytes=sent[1],
            whole_bytes=(shard or ShardCost(0)).whole_bytes, end_bytes=(shard or ShardCost(0)).end_bytes,
            once_s=(shard or ShardCost(0)).once_s)

    def estimate(self, plan: Plan) -> Estimate:
        plan.validate(self.num_layers, self.stages)
        if self._key(plan) != (self.microbatches, self.schedule, self.virtual, self.shards, self.sharding,
                               self.replicas):
            return CostModel.of(plan, self.profile, self.cluster).estimate(plan)
        if self.kind.chunked:
            return self._estimate_chunks(plan)
        costs = [self.stage_cost(s, plan.boundaries[s], plan.boundaries[s + 1], plan.policies) for s in range(self.stages)]
        fwd = tuple(c.forward_s for c in costs)
        bwd = tuple(c.backward_s for c in costs)
        step = self.cluster.step_overhead_s  # a weight step pays it too
        it = self.kind.iteration_time(fwd, bwd, self.microbatches, [c.wgrad_s + step for c in costs], self.hop_s,
                                      [c.inflight for c in costs]) + max(c.once_s for c in costs)
        return estimate_of(costs, it, self.cluster.budgets, self.microbatches)

    def chunks_iteration_s(self, chunk_s: Sequence[float], wgrad_s: Sequence[float] = ()) -> float:
        """The iteration from each chunk's time per micro-batch (``wgrad_s``: its W step's, for ZBV): see
        ``pipeline_time.chunks_iteration_time``."""
        return float(self.kind.chunks_iteration_time(chunk_s, wgrad_s, self.stages, self.microbatches, self.hop_s))

    def chunks_time_s(self, costs: Sequence[StageCost]) -> float:
        """``chunks_iteration_s`` from every chunk's cost (a W step pays the runtime's step overhead too)."""
        step = self.cluster.step_overhead_s  # a sharded stage's once-per-iteration collectives delay it whole
        once = max(sum(costs[c].once_s for c in range(len(costs)) if self.placement[c] == r) for r in range(self.stages))
        return self.chunks_iteration_s([c.total_s for c in costs], [c.wgrad_s + step for c in costs]) + once

    def rank_peak(self, rank: int, costs: Sequence[StageCost]) -> int:
        """Peak bytes of ``rank`` from its chunks' costs: the states along its order weighed by them (``chunks_peak``)."""
        return chunks_peak(costs, self.held(rank))

    def _estimate_chunks(self, plan: Plan) -> Estimate:
        """Virtual stages: each chunk costed on its own, a stage the sum of its chunks, the iteration from
        ``chunks_time_s``; a stage's activations from its chunks' (``rank_peak``)."""
        k, m = self.stages, self.microbatches
        costs = [self.stage_cost(c, plan.boundaries[c], plan.boundaries[c + 1], plan.policies) for c in range(self.chunks)]
        mine = [[costs[c] for c in plan.chunks_of(r)] for r in range(k)]
        fwd = tuple(sum(c.forward_s for c in cs) for cs in mine)
        bwd = tuple(sum(c.backward_s for c in cs) for cs in mine)
        total = tuple(f + b for f, b in zip(fwd, bwd))
        it = self.chunks_time_s(costs)
        dup = [self._shared.across([plan.chunk_layers(c) for c in plan.chunks_of(r)]) for r in range(k)]  # ZBV's ties
        static = tuple(sum(c.static_bytes for c in cs) - d for cs, d in zip(mine, dup))
        peaks = tuple(self.rank_peak(r, cs) - d for (r, cs), d in zip(enumerate(mine), dup))
        held = tuple(p - st for p, st in zip(peaks, static))  # with the rebuild its peak state runs into
        busy = sum(total) * m
        return Estimate(
            iteration_s=it, stage_s=total, peak_bytes=peaks, budget_bytes=self.cluster.budgets,
            bubble_fraction=(1.0 - busy / (k * it)) if it > 0 else 0.0,
            feasible=all(p <= b for p, b in zip(peaks, self.cluster.budgets)),
            forward_s=fwd, backward_s=bwd,
            recompute_s=tuple(sum(c.recompute_s for c in cs) for cs in mine),
            swap_exposed_s=tuple(sum(c.swap_exposed_s for c in cs) for cs in mine),
            comm_s=tuple(sum(c.comm_s for c in cs) for cs in mine),
            static_bytes=static, activation_bytes=held,
            host_bytes=tuple(max(c.host_bytes for c in cs) for cs in mine),
            inflight=tuple(max(c.inflight for c in cs) for cs in mine),
        )

    def lower_bound_s(self) -> float:
        """A bound no plan beats: every stage is at least the largest layer and the average stage, all compute runs."""
        largest, total = max(f + b for f, b in zip(self.fwd, self.bwd)), self.total_compute_s
        return total + (self.microbatches - 1) * max(largest, total / self.stages)


def estimate(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Estimate:
    """The cost model's estimate of ``plan`` on ``cluster`` (each of its ranks, on a sharded plan)."""
    return CostModel.of(plan, profile, cluster).estimate(plan)
