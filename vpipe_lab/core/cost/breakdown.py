"""Where each stage's iteration goes: compute, recompute, swaps, the wire, and waiting (the bubble); and which stage
bounds the iteration.

The same split is taken of a measured timeline (the workers' spans) and of a simulated one (the simulator's replay of
the running plan), so the two can stand side by side. Per iteration, the window is the iteration's first span's
start to its last span's end over every stage; in it each stage's time is

- compute: forward, backward and weight-gradient spans; recompute: layers rebuilt for their backward;
- swap: swap-out and swap-in spans (on a GPU they run on copy engines beside compute, so the shares can then add up
  to more than the whole);
- transfer: the wire: sends, and the part of a receive after its neighbour's matching send began (the bytes moving);
- bubble: waiting: the part of the window no work covers, and the part of a receive before the neighbour's send
  began (waiting for the neighbour to finish its work, which is the neighbour's time, not the link's); with the
  runtime's own time between actions.

The bottleneck is the stage whose work bounds the iteration: the most of the critical path's time
(``core/cost/critical_path.py``; each span's own part, so a receive's wait counts for its sender), measured and
predicted alike. ``StageTime.critical_s`` holds it, and ``StageTime.dominant`` the part its work is most of.
"""

from __future__ import annotations

from dataclasses import dataclass

from vpipe_lab.core.cost.critical_path import SLACK_S, critical_path
from vpipe_lab.core.timeline import Span, Timeline

PARTS = ("compute", "recompute", "swap", "transfer", "bubble")
_KIND_PART = {"forward": "compute", "backward": "compute", "wgrad": "compute", "recompute": "recompute",
              "swap_out": "swap", "swap_in": "swap", "send": "transfer", "recv": "transfer",
              "all_gather": "transfer", "reduce_scatter": "transfer"}


@dataclass(frozen=True)
class StageTime:
    """One stage's mean iteration split into ``PARTS`` (seconds per iteration), over ``iterations`` iterations."""

    stage: int
    iteration_s: float
    compute_s: float
    recompute_s: float
    swap_s: float
    transfer_s: float
    bubble_s: float
    iterations: int = 1
    critical_s: float = 0.0  # this stage's own time on the iteration's critical path (what bounds the iteration)
    bounded: int = 0  # the iterations whose critical path this stage held the most of

    def seconds(self, part: str) -> float:
        if part not in PARTS:
            raise ValueError(f"unknown part {part!r}: use one of {', '.join(PARTS)}")
        return float(getattr(self, f"{part}_s"))

    def share(self, part: str) -> float:
        """``part``'s share of the iteration (0 for an empty one)."""
        return self.seconds(part) / self.iteration_s if self.iteration_s > 0 else 0.0

    @property
    def dominant(self) -> str:
        """The part the stage's work is most of: "compute" (with recompute), "swap" or "transfer"."""
        work = {"compute": self.compute_s + self.recompute_s, "swap": self.swap_s, "transfer": self.transfer_s}
        return max(work, key=lambda k: work[k])


def breakdown(timeline: Timeline, replica: int = 0) -> list[StageTime]:
    """Each stage's mean split of its iterations in ``timeline`` (pipeline ``replica``), by stage; migrations and
    idle spans are not work and count as bubble."""
    by_iteration: dict[int, list[Span]] = {}
    for s in timeline:
        if s.replica == replica and s.kind not in ("idle", "migrate"):
            by_iteration.setdefault(s.iteration, []).append(s)
    stages = 1 + max((s.stage for spans in by_iteration.values() for s in spans), default=-1)
    totals = [[0.0] * (len(PARTS) + 2) for _ in range(stages)]  # per stage: PARTS..., the window, the critical time
    votes = [0] * stages  # per stage: the iterations it bounded
    for iteration, spans in by_iteration.items():
        start, end = min(s.start_s for s in spans), max(s.end_s for s in spans)
        wire = _wire(spans)
        for stage in range(stages):
            mine = [s for s in spans if s.stage == stage]
            row = totals[stage]
            for s in mine:
                row[PARTS.index(_KIND_PART[s.kind])] += wire[id(s)][1] - wire[id(s)][0] if s.kind == "recv" \
                    else s.duration_s
            covered = _covered([wire[id(s)] if s.kind == "recv" else (s.start_s, s.end_s) for s in mine])
            row[PARTS.index("bubble")] += max(0.0, (end - start) - covered)  # rounding, never below 0
            row[-2] += end - start
        path = critical_path(Timeline(tuple(spans)), iteration, replica)
        held = [0.0] * stages
        for s, own in zip(path.spans, path.own_s()):
            totals[s.stage][-1] += own
            held[s.stage] += own
        if any(held):
            votes[max(range(stages), key=lambda k: held[k])] += 1
    n = max(1, len(by_iteration))
    return [StageTime(stage, row[-2] / n, row[0] / n, row[1] / n, row[2] / n, row[3] / n, row[4] / n,
                      len(by_iteration), row[-1] / n, votes[stage]) for stage, row in enumerate(totals)]


def _wire(spans: list[Span]) -> dict[int, tuple[float, float]]:
    """Each receive's wire interval: from when the neighbour's matching send began (the latest send of the same
    micro-batch on another stage that began before the receive ended; the data's order makes it the one) to the
    receive's end. A receive with no send in view is all wire."""
    sends: dict[int, list[Span]] = {}
    for s in spans:
        if s.kind == "send":
            sends.setdefault(s.microbatch, []).append(s)
    out = {}
    for r in spans:
        if r.kind != "recv":
            continue
        begun = [s.start_s for s in sends.get(r.microbatch, ()) if s.stage != r.stage and s.start_s <= r.end_s + SLACK_S]
        out[id(r)] = (min(r.end_s, max(r.start_s, max(begun))) if begun else r.start_s, r.end_s)
    return out


@dataclass(frozen=True)
class ChunkTime:
    """One chunk's (virtual stage's) mean work per iteration: what of its stage's time it takes. The bubble belongs
    to the stage, whose chunks share one compute stream, so it has none of its own."""

    stage: int
    chunk: int  # the stage's own chunk number, as spans carry it (0: its first; the timeline's "stage s · c1")
    compute_s: float
    recompute_s: float
    swap_s: float
    transfer_s: float
    iterations: int = 1

    def seconds(self, part: str) -> float:
        if part not in PARTS or part == "bubble":
            raise ValueError(f"a chunk's parts are {', '.join(p for p in PARTS if p != 'bubble')}, not {part!r}")
        return float(getattr(self, f"{part}_s"))


def by_chunk(timeline: Timeline, replica: int = 0) -> list[ChunkTime]:
    """Each chunk's mean work per iteration in ``timeline`` (pipeline ``replica``), by stage then chunk: with virtual
    stages (interleaved 1F1B, ZBV) which of a stage's chunks its time goes to."""
    sums: dict[tuple[int, int], list[float]] = {}
    iterations = set()
    for s in timeline:
        if s.replica != replica or s.kind in ("idle", "migrate"):
            continue
        iterations.add(s.iteration)
        row = sums.setdefault((s.stage, s.chunk), [0.0] * 4)
        row[PARTS.index(_KIND_PART[s.kind])] += s.duration_s
    n = max(1, len(iterations))
    return [ChunkTime(stage, chunk, row[0] / n, row[1] / n, row[2] / n, row[3] / n, len(iterations))
            for (stage, chunk), row in sorted(sums.items())]


def bottleneck(times: list[StageTime]) -> int | None:
    """The stage whose work bounds the iteration: the one that held the most of the critical path in the most
    iterations, then the most time on it (one stalled op in one iteration moves a mean, not a count of iterations);
    without a path, the least waiting; None without stages."""
    if not times:
        return None
    if any(t.bounded for t in times):
        return max(times, key=lambda t: (t.bounded, t.critical_s, -t.bubble_s)).stage
    if any(t.critical_s > 0 for t in times):
        return max(times, key=lambda t: (t.critical_s, -t.bubble_s)).stage
    return min(times, key=lambda t: (t.bubble_s, -t.compute_s)).stage


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals (overlapping work counted once)."""
    total, cursor = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > cursor:
            total += end - max(start, cursor)
            cursor = end
    return total
