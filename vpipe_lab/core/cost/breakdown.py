"""Where each stage's iteration goes: compute, recompute, swaps, waiting on transfers, and the bubble.

The same split is taken of a measured timeline (the workers' spans) and of a simulated one (the simulator's replay of
the running plan), so the two can stand side by side. Per iteration, the window is the iteration's first span's
start to its last span's end over every stage; in it each stage's time is

- compute: forward, backward and weight-gradient spans; recompute: layers rebuilt for their backward;
- swap: swap-out and swap-in spans (on a GPU they run on copy engines beside compute, so the shares can then add up
  to more than the whole);
- transfer: sends and receives, a receive lasting as long as the stage waited for its neighbour;
- bubble: the part of the window no span of the stage covers: waiting with nothing to run while the pipeline fills
  and drains, and the runtime's own time between actions.

The bottleneck is the stage with the least bubble: the one every other stage waits for.
"""

from __future__ import annotations

from dataclasses import dataclass

from vpipe_lab.core.timeline import Span, Timeline

PARTS = ("compute", "recompute", "swap", "transfer", "bubble")
_KIND_PART = {"forward": "compute", "backward": "compute", "wgrad": "compute", "recompute": "recompute",
              "swap_out": "swap", "swap_in": "swap", "send": "transfer", "recv": "transfer"}


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

    def seconds(self, part: str) -> float:
        if part not in PARTS:
            raise ValueError(f"unknown part {part!r}: use one of {', '.join(PARTS)}")
        return float(getattr(self, f"{part}_s"))

    def share(self, part: str) -> float:
        """``part``'s share of the iteration (0 for an empty one)."""
        return self.seconds(part) / self.iteration_s if self.iteration_s > 0 else 0.0


def breakdown(timeline: Timeline, replica: int = 0) -> list[StageTime]:
    """Each stage's mean split of its iterations in ``timeline`` (pipeline ``replica``), by stage; migrations and
    idle spans are not work and count as bubble."""
    by_iteration: dict[int, list[Span]] = {}
    for s in timeline:
        if s.replica == replica and s.kind not in ("idle", "migrate"):
            by_iteration.setdefault(s.iteration, []).append(s)
    stages = 1 + max((s.stage for spans in by_iteration.values() for s in spans), default=-1)
    totals = [[0.0] * (len(PARTS) + 1) for _ in range(stages)]  # per stage: PARTS..., then the window
    for spans in by_iteration.values():
        start, end = min(s.start_s for s in spans), max(s.end_s for s in spans)
        for stage in range(stages):
            mine = [s for s in spans if s.stage == stage]
            row = totals[stage]
            for s in mine:
                row[PARTS.index(_KIND_PART[s.kind])] += s.duration_s
            row[PARTS.index("bubble")] += max(0.0, (end - start) - _covered(mine))  # rounding, never below 0
            row[-1] += end - start
    n = max(1, len(by_iteration))
    return [StageTime(stage, row[-1] / n, row[0] / n, row[1] / n, row[2] / n, row[3] / n, row[4] / n,
                      len(by_iteration)) for stage, row in enumerate(totals)]


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
    """The stage with the least bubble (None without stages)."""
    return min(times, key=lambda t: (t.bubble_s, -t.compute_s)).stage if times else None


def _covered(spans: list[Span]) -> float:
    """The length of the union of the spans' intervals (overlapping work counted once)."""
    total, cursor = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start_s):
        if s.end_s > cursor:
            total += s.end_s - max(s.start_s, cursor)
            cursor = s.end_s
    return total
