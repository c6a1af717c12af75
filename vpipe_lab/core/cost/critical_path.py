"""The critical path of an iteration: the chain of spans that decided when it ended, walked back from its last span.

Each step goes to whatever released the span: the work before it on its own stage, or, where it waited for data,
the neighbour's send that brought it (a measured receive lasts as long as its stage waited, so a receive whose
neighbour's send ended after it began waited for that send). Of the candidates that ended before the span began
(within ``slack`` seconds: the stages' clocks agree to about that), the one that ended last released it. A shorter
critical path needs a span on it to get shorter; making work off it faster changes nothing (Holistic Trace Analysis
and Dask's task stream show the same chain).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vpipe_lab.core.timeline import ASYNC_KINDS, Span, Timeline

SLACK_S = 5e-4
_NOT_WORK = ("idle", "migrate")


@dataclass(frozen=True)
class CriticalPath:
    """The spans of the path in time order, and where its time went."""

    spans: tuple[Span, ...]

    @property
    def seconds(self) -> float:
        return self.spans[-1].end_s - self.spans[0].start_s if self.spans else 0.0

    def own_s(self) -> list[float]:
        """Each span's own time on the path: the part after the span before it ended. A receive that waited began
        before the send that released it; the wait is the sender's time on the path, not the receiver's."""
        out, before = [], float("-inf")
        for s in self.spans:
            out.append(max(0.0, s.end_s - max(s.start_s, before)))
            before = max(before, s.end_s)
        return out

    def share(self, *, stage: int | None = None, kinds: Sequence[str] | None = None) -> float:
        """The share of the path's time in its spans on ``stage`` and/or of ``kinds`` (gaps between spans count for
        neither; time two spans of the path overlap counts once, for the earlier)."""
        if not self.spans or self.seconds <= 0:
            return 0.0
        busy = sum(own for s, own in zip(self.spans, self.own_s())
                   if (stage is None or s.stage == stage) and (kinds is None or s.kind in kinds))
        return busy / self.seconds

    def stages(self) -> list[int]:
        """The stages the path visits, in order, each run of one stage once (e.g. [0, 1, 0])."""
        out: list[int] = []
        for s in self.spans:
            if not out or out[-1] != s.stage:
                out.append(s.stage)
        return out


def critical_path(timeline: Timeline, iteration: int | None = None, replica: int = 0,
                  slack: float = SLACK_S) -> CriticalPath:
    """The critical path of ``iteration`` (default: the newest in ``timeline``) of pipeline ``replica``."""
    spans = [s for s in timeline if s.replica == replica and s.kind not in _NOT_WORK and s.kind not in ASYNC_KINDS]
    if iteration is None:
        iteration = max((s.iteration for s in spans), default=0)
    spans = [s for s in spans if s.iteration == iteration]
    if not spans:
        return CriticalPath(())
    by_stage: dict[int, list[Span]] = {}
    for s in sorted(spans, key=lambda s: (s.end_s, s.start_s)):
        by_stage.setdefault(s.stage, []).append(s)
    # each micro-batch's sends by end, indexed once (a walk asks for them at most steps; the breakdown walks every
    # iteration of the window on each dashboard refresh)
    sends_of: dict[int, list[Span]] = {}
    for c in sorted((c for done in by_stage.values() for c in done if c.kind == "send"), key=lambda c: c.end_s):
        sends_of.setdefault(c.microbatch, []).append(c)

    def latest(candidates: list[Span], before: float) -> Span | None:
        found = None
        for c in candidates:  # sorted by end: the last one that ended in time
            if c.end_s > before + slack:
                break
            found = c
        return found

    def released_by(s: Span) -> Span | None:
        own = latest([c for c in by_stage.get(s.stage, []) if c is not s and c.start_s < s.start_s], s.start_s)
        if s.kind not in ("recv", "forward", "backward", "recompute"):
            return own
        # the micro-batch's data came from another stage's send (a neighbour; with virtual stages any rank)
        at = s.end_s if s.kind == "recv" else s.start_s
        sent = latest([c for c in sends_of.get(s.microbatch, ()) if c.stage != s.stage], at)
        if sent is None:
            return own
        if s.kind == "recv":  # it waited when the send ended after the receive began
            return sent if sent.end_s > s.start_s + slack else own
        # work without a receive of its own: whichever ended last, its stage's previous work or the send
        return sent if own is None or sent.end_s > own.end_s + slack else own

    path = [max(spans, key=lambda s: (s.end_s, s.start_s))]
    seen = {id(path[0])}
    while (before := released_by(path[-1])) is not None and id(before) not in seen:
        seen.add(id(before))
        path.append(before)
    return CriticalPath(tuple(reversed(path)))
