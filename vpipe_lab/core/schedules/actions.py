"""Schedule IR: per-stage action lists (forward, backward, weight gradient, sends, receives, swaps, recompute) and
their discrete-event replay (``run_schedule``: the deadlock check and the simulator); ``core/schedules/builders.py`` builds
the schedules vpipe_lab runs.

An action prints as ``{stage}{op}{microbatch}`` with ``.{layer}`` for per-layer actions: ``1F0`` is stage 1's forward
of micro-batch 0, ``0SO2.3`` stage 0 swapping out layer 3's activations of micro-batch 2. ``parse`` reads that back.
With virtual stages (``interleaved-1f1b``, ``zbv``) an action's stage is its chunk, and a row runs the chunks placed on
it; two neighbouring chunks on one row (ZBV's turn) hand off locally, with no send or receive between them.
Swaps are asynchronous (copy engine); every other action occupies the stage's compute stream in list order.
In a zero-bubble schedule (``zb-h1``) ``B`` computes only the input's gradient and ``W`` the weights' gradients later
(``core/schedules/orders/zero_bubble.py``); elsewhere ``B`` is the whole backward and there is no ``W``.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from vpipe_lab.core.errors import ScheduleError
from vpipe_lab.core.timeline import Span, Timeline


class Op(StrEnum):
    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"
    SWAP_OUT = "SO"
    SWAP_IN = "SI"
    RECOMPUTE = "RC"


_ACTION = re.compile(r"^(\d+)(SF|RF|SB|RB|SO|SI|RC|F|B|W)(\d+)(?:\.(\d+))?$")


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
                "'0SO2.3' (ops: F B W SF RF SB RB SO SI RC)"
            )
        stage, op, mb, layer = match.groups()
        return cls(int(stage), Op(op), int(mb), int(layer) if layer is not None else None)


@dataclass(frozen=True)
class Schedule:
    """One action list per stage (row), executed in order; ``microbatches`` per iteration. An action's ``stage`` is
    its chunk (virtual stage); ``placement`` says which row runs each chunk (empty: chunk ``s`` on row ``s``)."""

    stages: tuple[tuple[Action, ...], ...]
    microbatches: int
    name: str = "custom"
    placement: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(tuple(row) for row in self.stages))
        object.__setattr__(self, "placement", tuple(self.placement) or tuple(range(len(self.stages))))

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def chunks(self) -> int:
        return len(self.placement)

    def to_strings(self) -> list[list[str]]:
        return [[str(a) for a in row] for row in self.stages]

    @classmethod
    def parse(cls, rows: Sequence[str | Sequence[str]], microbatches: int | None = None, name: str = "custom") -> Schedule:
        """Read one row per stage, each a whitespace-separated string or a list of action strings."""
        parsed = tuple(tuple(Action.parse(t) for t in (row.split() if isinstance(row, str) else row)) for row in rows)
        if microbatches is None:
            microbatches = 1 + max((a.microbatch for row in parsed for a in row), default=-1)
        return cls(parsed, microbatches, name)

    def local(self, chunk: int, later: int) -> bool:
        """Whether two chunks run on one row, so the hand-off between them is local, with no transfer (ZBV's turn:
        the last rank runs the model's middle two chunks)."""
        return self.placement[chunk] == self.placement[later]

    def compute_only(self) -> Schedule:
        """The forward/backward skeleton, which is what the staircase pictures show."""
        return Schedule(tuple(tuple(a for a in row if a.op in (Op.F, Op.B, Op.W)) for row in self.stages),
                        self.microbatches, self.name, self.placement)

    def __str__(self) -> str:
        return format_grid(self)

    def validate(self) -> Schedule:
        """Check the schedule is well formed and runs to the end; the error shows the grid with the step marked."""
        _check_rows(self)
        run_schedule(self, lambda action: 0.0 if action.op in (Op.RECV_F, Op.RECV_B) else 1.0)
        return self


def one_f_one_b_order(warmup: int, total: int) -> list[tuple[Op, int]]:
    """1F1B's shape over ``total`` forwards and backwards, by index: ``warmup`` forwards, then one forward and one
    backward alternately, then the backwards left (the plain and the interleaved generators both walk it)."""
    order = [(Op.F, i) for i in range(warmup)]
    f, b = warmup, 0
    while f < total:
        order += [(Op.F, f), (Op.B, b)]
        f, b = f + 1, b + 1
    return order + [(Op.B, j) for j in range(b, total)]


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
    k, m, last = schedule.num_stages, schedule.microbatches, schedule.chunks - 1
    if sorted(set(schedule.placement)) != list(range(k)):
        raise ScheduleError(f"placement {list(schedule.placement)} must put chunks on every row 0..{k - 1}")
    for s, row in enumerate(schedule.stages):
        seen: dict[tuple[Op, int, int, int | None], int] = {}
        for i, a in enumerate(row):
            c = a.stage
            owner = schedule.placement[c] if 0 <= c <= last else c
            if owner != s:
                raise _fail(schedule, s, i, f"stage {s} step {i}: action {a} belongs to stage {owner}")
            if not 0 <= a.microbatch < m:
                raise _fail(schedule, s, i, f"stage {s} step {i}: micro-batch {a.microbatch} is outside 0..{m - 1}")
            if (a.op in (Op.SEND_F, Op.RECV_B) and (c == last or schedule.local(c, c + 1))) or (
                    a.op in (Op.RECV_F, Op.SEND_B) and (c == 0 or schedule.local(c - 1, c))):
                raise _fail(schedule, s, i, f"stage {s} step {i}: {a} has no neighbour on another stage to talk to")
            key = (a.op, c, a.microbatch, a.layer)
            if key in seen:
                raise _fail(schedule, s, i, f"stage {s} step {i}: {a} repeats step {seen[key]}")
            seen[key] = i
            needs: list[tuple[Op, int, int | None, str]] = []  # (op, chunk, layer, why) that must have run
            if a.op is Op.F and c > 0:
                needs.append((Op.F, c - 1, None, "the chunk before it runs here and must run first") if schedule.local(
                    c - 1, c) else (Op.RECV_F, c, None, "its input must be received first"))
            if a.op is Op.B:
                needs.append((Op.F, c, None, "a micro-batch's backward needs its forward first"))
                if c < last:
                    needs.append((Op.B, c + 1, None, "the chunk after it runs here and its backward must run first")
                                 if schedule.local(c, c + 1) else
                                 (Op.RECV_B, c, None, "its output gradient must be received first"))
            if a.op in (Op.SEND_F, Op.SWAP_OUT, Op.RECOMPUTE):
                needs.append((Op.F, c, None, "it needs the forward to have run"))
            if a.op in (Op.SEND_B, Op.W):
                needs.append((Op.B, c, None, "it needs the backward to have run"))
            if a.op is Op.SWAP_IN:
                needs.append((Op.SWAP_OUT, c, a.layer, "a swap-in needs the matching swap-out first"))
            for op, chunk, layer, why in needs:
                if (op, chunk, a.microbatch, layer) not in seen:
                    raise _fail(schedule, s, i, f"stage {s} step {i}: {a} comes too early: {why}")
        split = any(a.op is Op.W for a in row)  # a zero-bubble row: every backward's weight step must follow
        end = len(row) - 1 if row else 0
        for c in (c for c, r in enumerate(schedule.placement) if r == s):
            for mb in range(m):
                for op in (Op.F, Op.B, Op.W) if split else (Op.F, Op.B):
                    if (op, c, mb, None) not in seen:
                        raise _fail(schedule, s, end, f"stage {s} never runs {Action(c, op, mb)}: every stage runs F and "
                                    "B (and W, once it splits its backward) of every micro-batch")
                before = c > 0 and not schedule.local(c - 1, c)
                after = c < last and not schedule.local(c, c + 1)
                for op, present in ((Op.RECV_F, before), (Op.SEND_F, after), (Op.RECV_B, after), (Op.SEND_B, before)):
                    if present and (op, c, mb, None) not in seen:
                        raise _fail(schedule, s, end,
                                    f"stage {s} never runs {Action(c, op, mb)}, which its neighbour waits for")
        for (op, c, mb, layer), i in seen.items():
            if op is Op.SWAP_OUT and (Op.SWAP_IN, c, mb, layer) not in seen:
                raise _fail(schedule, s, i, f"stage {s} step {i}: {row[i]} is never swapped back in before backward")
            if op in (Op.SWAP_IN, Op.RECOMPUTE) and seen[(Op.B, c, mb, None)] < i:
                raise _fail(schedule, s, i, f"stage {s} step {i}: {row[i]} comes after the backward that needs it")


# --- replay: the deadlock check here and the simulator (core/cost/simulator.py) both run a schedule through this ---
KIND = {
    Op.F: "forward", Op.B: "backward", Op.W: "wgrad", Op.RECOMPUTE: "recompute", Op.SEND_F: "send", Op.SEND_B: "send",
    Op.RECV_F: "recv", Op.RECV_B: "recv", Op.SWAP_OUT: "swap_out", Op.SWAP_IN: "swap_in",
}


def chunk_indices(schedule: Schedule) -> list[int]:
    """Each chunk's index among its row's chunks, in order (what a span's ``chunk`` says)."""
    seen: dict[int, int] = {}
    out = []
    for row in schedule.placement:
        out.append(seen.get(row, 0))
        seen[row] = out[-1] + 1
    return out


def run_schedule(
    schedule: Schedule,
    duration: Callable[[Action], float],
    *,
    sends_use_copy_lane: bool = False,
    iteration: int = 0,
    latency_s: float = 0.0,
    swaps_on_compute: bool = False,
) -> Timeline:
    """Replay ``schedule`` with ``duration(action)`` seconds per action, each transfer arriving ``latency_s`` after
    its send ends (``swaps_on_compute``: swaps run on the compute stream, as on CPU ranks, not on copy lanes);
    raise ScheduleError on deadlock."""
    return _Replay(schedule, duration, sends_use_copy_lane, iteration, latency_s, swaps_on_compute).run()


class _Replay:
    """``run_schedule``'s state: each row's position and clocks (compute, outgoing and incoming copy lanes), when
    each transfer arrives and each swap ends, and the spans so far."""

    def __init__(self, schedule: Schedule, duration: Callable[[Action], float], sends_use_copy_lane: bool,
                 iteration: int, latency_s: float, swaps_on_compute: bool) -> None:
        self.schedule, self.duration, self.iteration, self.latency_s = schedule, duration, iteration, latency_s
        self.copy_sends, self.swaps_on_compute = sends_use_copy_lane, swaps_on_compute
        k = schedule.num_stages
        self.pc, self.clock, self.lane_out, self.lane_in = [0] * k, [0.0] * k, [0.0] * k, [0.0] * k
        self.arrivals: dict[tuple[int, Op, int], float] = {}  # (sending chunk, send op, micro-batch) -> arrival
        self.swapped_out: dict[tuple[int, int, int | None], float] = {}
        self.swapped_in: dict[tuple[int, int], float] = {}  # (chunk, micro-batch) -> when its last swap-in ends
        self.spans: list[Span] = []
        self.local = chunk_indices(schedule)
        self.ready: deque[int] = deque(range(k))
        self.waiting: dict[tuple[int, Op, int], int] = {}  # what a blocked row waits for -> that row

    def run(self) -> Timeline:
        # Event-driven: a row runs until a receive blocks it, registers what it waits for, and the matching send
        # wakes it up again, so every action is replayed exactly once (linear in the schedule's length).
        while self.ready:
            s = self.ready.popleft()
            row = self.schedule.stages[s]
            while self.pc[s] < len(row):
                a = row[self.pc[s]]
                if a.op in (Op.RECV_F, Op.RECV_B):
                    if not self._receive(s, a):
                        break  # blocked until the neighbour sends
                elif a.op in (Op.SWAP_OUT, Op.SWAP_IN):
                    self._swap(s, a)
                else:
                    self._compute(s, a)
                self.pc[s] += 1
        stuck = [s for s, row in enumerate(self.schedule.stages) if self.pc[s] < len(row)]
        if stuck:
            blocked = ", ".join(f"stage {s} waits at {self.schedule.stages[s][self.pc[s]]}" for s in stuck)
            raise ScheduleError(
                f"the schedule deadlocks: {blocked}; no stage can move. Reorder the sends and receives so every "
                f"receive's matching send can happen first.\n" + format_grid(self.schedule, (stuck[0], self.pc[stuck[0]]))
            )
        return Timeline(tuple(self.spans))

    def _add(self, s: int, a: Action, start: float, end: float) -> None:
        if end > start or a.op in (Op.F, Op.B, Op.W):
            self.spans.append(Span(s, KIND[a.op], a.microbatch, a.layer, start, end, self.iteration, 0,
                                   self.local[a.stage]))

    def _receive(self, s: int, a: Action) -> bool:
        """Run a receive once its transfer has arrived; False (and row ``s`` waits) while it has not."""
        c = a.stage
        key = (c - 1, Op.SEND_F, a.microbatch) if a.op is Op.RECV_F else (c + 1, Op.SEND_B, a.microbatch)
        arrival = self.arrivals.get(key)
        if arrival is None:
            self.waiting[key] = s
            return False
        start = self.clock[s]
        self.clock[s] = max(start, arrival) + self.duration(a)
        self._add(s, a, start, self.clock[s])
        return True

    def _swap(self, s: int, a: Action) -> None:
        """A swap on the compute stream (CPU ranks), or on its copy lane; a swap-in waits for its swap-out."""
        c, key = a.stage, (a.stage, a.microbatch, a.layer)
        if self.swaps_on_compute:
            start = self.clock[s]
            self.clock[s] = end = start + self.duration(a)
            if a.op is Op.SWAP_OUT:
                self.swapped_out[key] = end
        elif a.op is Op.SWAP_OUT:
            start = max(self.lane_out[s], self.clock[s])
            self.lane_out[s] = end = start + self.duration(a)
            self.swapped_out[key] = end
        else:
            start = max(self.lane_in[s], self.clock[s], self.swapped_out.get(key, 0.0))
            self.lane_in[s] = end = start + self.duration(a)
            self.swapped_in[(c, a.microbatch)] = max(self.swapped_in.get((c, a.microbatch), 0.0), end)
        self._add(s, a, start, end)

    def _compute(self, s: int, a: Action) -> None:
        """Forward, backward, weight step, recompute or a send (which wakes the row waiting for it)."""
        op, c = a.op, a.stage
        start = self.clock[s]
        if op is Op.B:
            start = max(start, self.swapped_in.get((c, a.microbatch), 0.0))
        sending = op in (Op.SEND_F, Op.SEND_B)
        if sending and self.copy_sends:
            start = max(start, self.lane_out[s])
        self.clock[s] = end = start + self.duration(a)
        if sending:
            self.arrivals[(c, op, a.microbatch)] = end + self.latency_s
            if self.copy_sends:
                self.lane_out[s] = end
            woken = self.waiting.pop((c, op, a.microbatch), None)
            if woken is not None:
                self.ready.append(woken)
        self._add(s, a, start, end)
