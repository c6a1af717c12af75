"""Schedule IR: per-stage action lists (forward, backward, sends, receives, swaps, recompute), their generators and
their discrete-event replay (``run_schedule``: the deadlock check and the simulator).

An action prints as ``{stage}{op}{microbatch}`` with ``.{layer}`` for per-layer actions: ``1F0`` is stage 1's forward
of micro-batch 0, ``0SO2.3`` stage 0 swapping out layer 3's activations of micro-batch 2. ``parse`` reads that back.
Swaps are asynchronous (copy engine); every other action occupies the stage's compute stream in list order.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from vpipe_lab.core.errors import ScheduleError
from vpipe_lab.core.plan import Plan, Policy
from vpipe_lab.core.timeline import Span, Timeline


class Op(StrEnum):
    F = "F"
    B = "B"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"
    SWAP_OUT = "SO"
    SWAP_IN = "SI"
    RECOMPUTE = "RC"


_ACTION = re.compile(r"^(\d+)(SF|RF|SB|RB|SO|SI|RC|F|B)(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True)
class Action:
    stage: int
    op: Op
    microbatch: int
    layer: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.microbatch}" + (f".{self.layer}" if self.layer is not None else "")

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION.match(text.strip())
        if not match:
            raise ScheduleError(
                f"cannot read action {text!r}: write stage, op, micro-batch and optional .layer, e.g. '1F0' or "
                "'0SO2.3' (ops: F B SF RF SB RB SO SI RC)"
            )
        stage, op, mb, layer = match.groups()
        return cls(int(stage), Op(op), int(mb), int(layer) if layer is not None else None)


@dataclass(frozen=True)
class Schedule:
    """One action list per stage, executed in order; ``microbatches`` per iteration."""

    stages: tuple[tuple[Action, ...], ...]
    microbatches: int
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(tuple(row) for row in self.stages))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def to_strings(self) -> list[list[str]]:
        return [[str(a) for a in row] for row in self.stages]

    @classmethod
    def parse(cls, rows: Sequence[str | Sequence[str]], microbatches: int | None = None, name: str = "custom") -> Schedule:
        """Read one row per stage, each a whitespace-separated string or a list of action strings."""
        parsed = tuple(tuple(Action.parse(t) for t in (row.split() if isinstance(row, str) else row)) for row in rows)
        if microbatches is None:
            microbatches = 1 + max((a.microbatch for row in parsed for a in row), default=-1)
        return cls(parsed, microbatches, name)

    def compute_only(self) -> Schedule:
        """The forward/backward skeleton, which is what the staircase pictures show."""
        return Schedule(tuple(tuple(a for a in row if a.op in (Op.F, Op.B)) for row in self.stages),
                        self.microbatches, self.name)

    def __str__(self) -> str:
        return format_grid(self)

    def validate(self) -> Schedule:
        """Check the schedule is well formed and runs to the end; the error shows the grid with the step marked."""
        _check_rows(self)
        run_schedule(self, lambda action: 0.0 if action.op in (Op.RECV_F, Op.RECV_B) else 1.0)
        return self


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None, note: str = "") -> str:
    """Rows of actions per stage; the action at ``mark`` = (stage, step) is bracketed as >>1F0<<."""
    rows = schedule.to_strings()
    width = max((len(t) for row in rows for t in row), default=2) + 4
    lines = []
    for s, row in enumerate(rows):
        cells = []
        for i, text in enumerate(row):
            cells.append((f">>{text}<<" if mark == (s, i) else text).ljust(width))
        lines.append(f"stage {s}: " + "".join(cells).rstrip())
    if note:
        lines.append(note)
    return "\n".join(lines)


def _fail(schedule: Schedule, stage: int, step: int, message: str) -> ScheduleError:
    return ScheduleError(f"{message}\n{format_grid(schedule, (stage, step))}")


def _check_rows(schedule: Schedule) -> None:
    k, m = schedule.num_stages, schedule.microbatches
    for s, row in enumerate(schedule.stages):
        seen: dict[tuple[Op, int, int | None], int] = {}
        for i, a in enumerate(row):
            if a.stage != s:
                raise _fail(schedule, s, i, f"stage {s} step {i}: action {a} belongs to stage {a.stage}")
            if not 0 <= a.microbatch < m:
                raise _fail(schedule, s, i, f"stage {s} step {i}: micro-batch {a.microbatch} is outside 0..{m - 1}")
            if (a.op in (Op.SEND_F, Op.RECV_B) and s == k - 1) or (a.op in (Op.RECV_F, Op.SEND_B) and s == 0):
                raise _fail(schedule, s, i, f"stage {s} step {i}: {a} has no neighbour to talk to")
            key = (a.op, a.microbatch, a.layer)
            if key in seen:
                raise _fail(schedule, s, i, f"stage {s} step {i}: {a} repeats step {seen[key]}")
            seen[key] = i
            needs: list[tuple[Op, int | None, str]] = []
            if a.op is Op.F and s > 0:
                needs.append((Op.RECV_F, None, "its input must be received first"))
            if a.op is Op.B:
                needs.append((Op.F, None, "a micro-batch's backward needs its forward first"))
                if s < k - 1:
                    needs.append((Op.RECV_B, None, "its output gradient must be received first"))
            if a.op in (Op.SEND_F, Op.SWAP_OUT, Op.RECOMPUTE):
                needs.append((Op.F, None, "it needs the forward to have run"))
            if a.op is Op.SEND_B:
                needs.append((Op.B, None, "it needs the backward to have run"))
            if a.op is Op.SWAP_IN:
                needs.append((Op.SWAP_OUT, a.layer, "a swap-in needs the matching swap-out first"))
            for op, layer, why in needs:
                if (op, a.microbatch, layer) not in seen:
                    raise _fail(schedule, s, i, f"stage {s} step {i}: {a} comes too early: {why}")
        for mb in range(m):
            for op in (Op.F, Op.B):
                if (op, mb, None) not in seen:
                    raise _fail(schedule, s, len(row) - 1 if row else 0,
                                f"stage {s} never runs {Action(s, op, mb)}: every stage runs F and B of every micro-batch")
            for op, present in ((Op.RECV_F, s > 0), (Op.SEND_F, s < k - 1), (Op.RECV_B, s < k - 1), (Op.SEND_B, s > 0)):
                if present and (op, mb, None) not in seen:
                    raise _fail(schedule, s, len(row) - 1 if row else 0,
                                f"stage {s} never runs {Action(s, op, mb)}, which its neighbour waits for")
        for (op, mb, layer), i in seen.items():
            if op is Op.SWAP_OUT and (Op.SWAP_IN, mb, layer) not in seen:
                raise _fail(schedule, s, i, f"stage {s} step {i}: {row[i]} is never swapped back in before backward")
            if op in (Op.SWAP_IN, Op.RECOMPUTE) and seen[(Op.B, mb, None)] < i:
                raise _fail(schedule, s, i, f"stage {s} step {i}: {row[i]} comes after the backward that needs it")


def _expand(stage: int, order: list[tuple[Op, int]], k: int, plan: Plan | None) -> tuple[Action, ...]:
    """Turn a stage's F/B order into full actions: receives, sends, swaps (prefetched one step early), recompute."""
    swapped: list[int] = []
    recomputed: list[int] = []
    if plan is not None:
        layers = plan.layers_of(stage)
        swapped = [i for i in layers if plan.policies[i] is Policy.SWAP]
        recomputed = [i for i in layers if plan.policies[i] is Policy.RECOMPUTE]
    out: list[Action] = []
    forwarded: set[int] = set()
    for pos, (op, mb) in enumerate(order):
        if op is Op.F:
            forwarded.add(mb)
            if stage > 0:
                out.append(Action(stage, Op.RECV_F, mb))
            out.append(Action(stage, Op.F, mb))
            out.extend(Action(stage, Op.SWAP_OUT, mb, i) for i in swapped)
            if stage < k - 1:
                out.append(Action(stage, Op.SEND_F, mb))
        else:
            if stage < k - 1:
                out.append(Action(stage, Op.RECV_B, mb))
            out.extend(Action(stage, Op.RECOMPUTE, mb, i) for i in reversed(recomputed))
            out.append(Action(stage, Op.B, mb))
            if stage > 0:
                out.append(Action(stage, Op.SEND_B, mb))
        # Prefetch: a backward's swap-ins are issued before the compute step that precedes it, so they overlap it.
        if swapped and pos + 2 < len(order) and order[pos + 2][0] is Op.B:
            mb_next = order[pos + 2][1]
            if mb_next in forwarded:
                out.extend(Action(stage, Op.SWAP_IN, mb_next, i) for i in reversed(swapped))
    # A backward right at the start of the list or right after another backward still needs its swap-ins.
    have = {(a.microbatch, a.layer) for a in out if a.op is Op.SWAP_IN}
    fixed: list[Action] = []
    for a in out:
        if a.op is Op.B:
            fixed.extend(Action(stage, Op.SWAP_IN, a.microbatch, i) for i in reversed(swapped)
                         if (a.microbatch, i) not in have)
        fixed.append(a)
    return tuple(fixed)


def gpipe(stages: int, microbatches: int, plan: Plan | None = None) -> Schedule:
    """GPipe with a flush: every forward, then every backward, in micro-batch order."""
    rows = []
    for s in range(stages):
        order = [(Op.F, m) for m in range(microbatches)] + [(Op.B, m) for m in range(microbatches)]
        rows.append(_expand(s, order, stages, plan))
    return Schedule(tuple(rows), microbatches, "gpipe")


def one_f_one_b(stages: int, microbatches: int, plan: Plan | None = None, *, eager: bool = False) -> Schedule:
    """1F1B with a flush (PipeDream-Flush): K-s-1 warm-up forwards, alternate, then drain the backwards. ``eager``
    adds one warm-up forward on every stage but the last: in the steady state a stage's next forward input and its
    next gradient then arrive while it computes, instead of one transfer latency each way per micro-batch on the
    critical path (at the cost of one more micro-batch of activations on those stages)."""
    rows = []
    for s in range(stages):
        warm = min(stages - s - 1 + (1 if eager and s < stages - 1 else 0), microbatches)
        order: list[tuple[Op, int]] = [(Op.F, m) for m in range(warm)]
        f, b = warm, 0
        while f < microbatches:
            order.append((Op.F, f))
            f += 1
            order.append((Op.B, b))
            b += 1
        order.extend((Op.B, m) for m in range(b, microbatches))
        rows.append(_expand(s, order, stages, plan))
    return Schedule(tuple(rows), microbatches, "eager-1f1b" if eager else "1f1b")


def for_plan(plan: Plan) -> Schedule:
    """The schedule a plan runs: its kind, stages and micro-batches, with its swaps and recomputes."""
    if plan.schedule == "gpipe":
        return gpipe(plan.stages, plan.microbatches, plan)
    return one_f_one_b(plan.stages, plan.microbatches, plan, eager=plan.schedule == "eager-1f1b")


# --- replay: the deadlock check here and the simulator (core/simulator.py) both run a schedule through this ---
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
