"""The simulator: a plan's schedule replayed (``schedule.run_schedule``) with the cost model's durations.

The replay is discrete-event: each stage has a compute stream that runs its actions in order and two copy lanes
(device-to-host and host-to-device) for swaps. Sends occupy the sender's compute stream for their bytes over the
link (blocking, buffered); a receive waits until the matching send has ended and the link's latency has passed.
With ``Cluster.shared_link`` sends also occupy the device-to-host lane, so swaps compete with pipeline traffic as
they do on a PCIe-only machine. A backward waits for its swap-ins. Without ``Cluster.swap_overlaps`` (CPU ranks,
which copy on their compute thread) swaps run on the compute stream.
"""

from __future__ import annotations

from collections.abc import Callable

from vpipe_lab.core.cost.costmodel import CostModel
from vpipe_lab.core.cost.sharded import ShardCost
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.core.schedules.actions import Action, Op, Schedule, chunk_indices, run_schedule
from vpipe_lab.core.schedules.builders import for_plan
from vpipe_lab.core.timeline import Timeline


def durations(cm: CostModel, plan: Plan) -> Callable[[Action], float]:
    """The cost model's duration of every action of ``plan``'s schedule."""
    bounds = plan.boundaries
    bw = cm.cluster.swap_bandwidth
    split = plan.kind.split_backward  # B is the input's gradient only; W the weights'
    step = cm.cluster.step_overhead_s  # the runtime's own time per compute step

    def duration(a: Action) -> float:
        lo, hi = bounds[a.stage], bounds[a.stage + 1]
        # a sharded stage's collectives: per micro-batch with its forward and backward, and those once per
        # iteration with the first forward (core/cost/sharded.py)
        shard = cm.shard_cost(a.stage, lo, hi) or ShardCost(0)
        if a.op is Op.F:
            return cm.forward_compute_s(lo, hi) + step + shard.forward_s + (shard.once_s if a.microbatch == 0 else 0.0)
        if a.op is Op.B:  # (under PipeDream the stage's update follows each backward)
            return (cm.backward_compute_s(lo, hi) - (cm.wgrad_compute_s(lo, hi) if split else 0.0) + step
                    + cm.update_s(cm.placement[a.stage], lo, hi) + shard.backward_s)
        if a.op is Op.W:
            return cm.wgrad_compute_s(lo, hi) + step
        if a.op is Op.RECOMPUTE:
            return cm.fwd[a.layer] if a.layer is not None else 0.0
        if a.op is Op.SEND_F:
            return cm.send_forward_s(a.stage, hi)
        if a.op is Op.SEND_B:
            return cm.send_backward_s(a.stage, lo)
        if a.op in (Op.SWAP_OUT, Op.SWAP_IN):
            return cm.act[a.layer] / bw if a.layer is not None else 0.0
        return 0.0

    return duration


def simulate(plan: Plan, profile: ModelProfile, cluster: Cluster, *, schedule: Schedule | None = None,
             iteration: int = 0) -> Timeline:
    """The simulated timeline of one iteration of ``plan``; its ``iteration_s`` is the predicted iteration time."""
    cm = CostModel.of(plan, profile, cluster)
    plan.validate(cm.num_layers, cm.stages)
    sched = schedule if schedule is not None else for_plan(plan)
    return run_schedule(sched, durations(cm, plan), sends_use_copy_lane=cluster.shared_link, iteration=iteration,
                        latency_s=cm.hop_s, swaps_on_compute=not cluster.swap_overlaps)


def period_s(plan: Plan, profile: ModelProfile, cluster: Cluster) -> float:
    """The predicted time from one iteration's start to the next one's: the replayed iteration, then the optimizer
    step and the boundary between iterations as the cluster measured them (``Cluster.iteration_overhead_s``)."""
    return simulate(plan, profile, cluster).iteration_s + cluster.iteration_overhead_s


def compute_bound_s(schedule: Schedule, measured: Timeline) -> float:
    """The shortest iteration ``schedule`` allows with ``measured``'s compute times and free transfers and swaps:
    the bubble limit of these stages, as they really ran (unequal stages and micro-batches included; the textbook
    ``1 - (K - 1) / (M + K - 1)`` assumes equal ones). A measured iteration over this bound is the runtime's own
    overhead on the critical path: transfer latency, waiting, bookkeeping.

    ``measured`` holds one iteration's spans; each forward, backward, weight-step and recompute action takes the
    total of its spans (stage, chunk, kind, micro-batch and layer), an action without a span takes no time.
    """
    took: dict[tuple[int, int, str, int, int | None], float] = {}
    for span in measured:
        key = (span.stage, span.chunk, span.kind, span.microbatch, span.layer)
        took[key] = took.get(key, 0.0) + span.duration_s
    kinds = {Op.F: "forward", Op.B: "backward", Op.W: "wgrad", Op.RECOMPUTE: "recompute"}
    local = chunk_indices(schedule)

    def duration(a: Action) -> float:
        kind = kinds.get(a.op)
        where = (schedule.placement[a.stage], local[a.stage])
        return 0.0 if kind is None else took.get((*where, kind, a.microbatch, a.layer), 0.0)

    return run_schedule(schedule, duration).iteration_s
