"""Discrete-event replay of a schedule with the cost model's durations; reports the timeline or the deadlock.

Each stage has a compute stream that runs its actions in order and two copy lanes (device-to-host and host-to-device)
for swaps. Sends occupy the sender's compute stream (blocking, buffered); a receive waits until the matching send
has ended. With ``Cluster.shared_link`` sends also occupy the device-to-host lane, so swaps compete with pipeline
traffic as they do on a PCIe-only machine. A backward waits for its swap-ins.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from vpipe_lab.core.costmodel import CostModel
from vpipe_lab.core.errors import ScheduleError
from vpipe_lab.core.model import Cluster, ModelProfile, Plan
from vpipe_lab.core.schedule import Action, Op, Schedule, for_plan, format_grid
from vpipe_lab.core.timeline import Span, Timeline

_KIND = {
    Op.F: "forward", Op.B: "backward", Op.RECOMPUTE: "recompute", Op.SEND_F: "send", Op.SEND_B: "send",
    Op.RECV_F: "recv", Op.RECV_B: "recv", Op.SWAP_OUT: "swap_out", Op.SWAP_IN: "swap_in",
}


def run_schedule(
    schedule: Schedule,
    duration: Callable[[Action], float],
    *,
    sends_use_copy_lane: bool = False,
    iteration: int = 0,
) -> Timeline:
    """Replay ``schedule`` with ``duration(action)`` seconds per action; raise ScheduleError on deadlock."""
    k = schedule.num_stages
    pc = [0] * k
    clock = [0.0] * k
    lane_out = [0.0] * k
    lane_in = [0.0] * k
    arrivals: dict[tuple[int, Op, int], float] = {}
    swapped_out: dict[tuple[int, int, int | None], float] = {}
    swapped_in: dict[tuple[int, int], float] = {}  # (stage, micro-batch) -> when its last swap-in ends
    spans: list[Span] = []

    def add(a: Action, start: float, end: float) -> None:
        if end > start or a.op in (Op.F, Op.B):
            spans.append(Span(a.stage, _KIND[a.op], a.microbatch, a.layer, start, end, iteration))

    # Event-driven: a stage runs until a receive blocks it, registers what it waits for, and the matching send wakes
    # it up again, so every action is replayed exactly once (linear in the schedule's length).
    ready: deque[int] = deque(range(k))
    waiting: dict[tuple[int, Op, int], int] = {}
    while ready:
        s = ready.popleft()
        row = schedule.stages[s]
        while pc[s] < len(row):
            a = row[pc[s]]
            op = a.op
            if op in (Op.RECV_F, Op.RECV_B):
                src = s - 1 if op is Op.RECV_F else s + 1
                key = (src, Op.SEND_F if op is Op.RECV_F else Op.SEND_B, a.microbatch)
                arrival = arrivals.get(key)
                if arrival is None:
                    waiting[key] = s
                    break  # blocked until the neighbour sends
                start = clock[s]
                clock[s] = max(clock[s], arrival) + duration(a)
                add(a, start, clock[s])
            elif op is Op.SWAP_OUT:
                start = max(lane_out[s], clock[s])
                lane_out[s] = start + duration(a)
                swapped_out[(s, a.microbatch, a.layer)] = lane_out[s]
                add(a, start, lane_out[s])
            elif op is Op.SWAP_IN:
                start = max(lane_in[s], clock[s], swapped_out.get((s, a.microbatch, a.layer), 0.0))
                lane_in[s] = start + duration(a)
                swapped_in[(s, a.microbatch)] = max(swapped_in.get((s, a.microbatch), 0.0), lane_in[s])
                add(a, start, lane_in[s])
            else:
                start = clock[s]
                if op is Op.B:
                    start = max(start, swapped_in.get((s, a.microbatch), 0.0))
                if op in (Op.SEND_F, Op.SEND_B) and sends_use_copy_lane:
                    start = max(start, lane_out[s])
                end = start + duration(a)
                clock[s] = end
                if op in (Op.SEND_F, Op.SEND_B):
                    arrivals[(s, op, a.microbatch)] = end
                    if sends_use_copy_lane:
                        lane_out[s] = end
                    woken = waiting.pop((s, op, a.microbatch), None)
                    if woken is not None:
                        ready.append(woken)
                add(a, start, end)
            pc[s] += 1
    stuck = [s for s in range(k) if pc[s] < len(schedule.stages[s])]
    if stuck:
        blocked = ", ".join(f"stage {s} waits at {schedule.stages[s][pc[s]]}" for s in stuck)
        raise ScheduleError(
            f"the schedule deadlocks: {blocked}; no stage can move. Reorder the sends and receives so every receive's "
            f"matching send can happen first.\n" + format_grid(schedule, (stuck[0], pc[stuck[0]]))
        )
    return Timeline(tuple(spans))


def durations(cm: CostModel, plan: Plan) -> Callable[[Action], float]:
    """The cost model's duration of every action of ``plan``'s schedule."""
    bounds = plan.boundaries
    bw = cm.cluster.swap_bandwidth

    def duration(a: Action) -> float:
        lo, hi = bounds[a.stage], bounds[a.stage + 1]
        if a.op is Op.F:
            return cm.forward_compute_s(lo, hi)
        if a.op is Op.B:
            return cm.backward_compute_s(lo, hi)
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
    cm = CostModel(profile, cluster, plan.microbatches, plan.schedule)
    plan.validate(cm.num_layers, cm.stages)
    sched = schedule if schedule is not None else for_plan(plan)
    return run_schedule(sched, durations(cm, plan), sends_use_copy_lane=cluster.shared_link, iteration=iteration)
