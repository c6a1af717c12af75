"""The record of a session: every plan that ran (the one it began with, each applied change, each re-plan after a
stage could not come back), the iterations it ran, what they measured, what the cost model predicted, who asked; and
two of them side by side.

Entries are numbered from 0 (the first plan) in the order they came into force: ``session.history`` is the table,
``session.revert(N)`` (``%vpipe revert N``) returns to entry N's plan, ``session.compare(A, B)`` puts two entries'
measured splits side by side. The measured times come from the iteration table, which is kept whole; the spans behind
a split are a rolling window, so each entry's split and last iteration's spans are kept when the next entry has taken
over (a few kilobytes each, for the newest ``KEEP`` entries).
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass
from typing import Any

from vpipe_lab.control.state import JobState
from vpipe_lab.core.change import Applied
from vpipe_lab.core.cost.breakdown import StageTime, bottleneck, breakdown
from vpipe_lab.core.timeline import Timeline
from vpipe_lab.telemetry.metrics import Metrics, breakdown_frame

KEEP = 64  # entries whose split and spans are kept once they ended (older ones keep their row in the table)
SPLIT_ITERATIONS = 10  # an entry's split is its last iterations' mean
LOOK_BACK = 20_000  # an entry's median time and samples/s are over at most its newest this many iterations


@dataclass
class Entry:
    """One plan's time in force."""

    number: int
    applied: Applied
    until: int | None = None  # the iteration the next entry took over at (None: in force)
    split: list[StageTime] | None = None  # kept once it ended
    last: Timeline | None = None  # its last iteration's spans, kept once it ended
    kept: bool = False  # split and last were taken (None when no span of it was in the window)
    measured: dict[str, Any] | None = None  # its iterations, median time and samples/s, once it ended


class History:
    """Built from the job state's record of changes and the metrics; ``observe`` sees every event (keeps splits)."""

    def __init__(self, state: JobState, metrics: Metrics, lock: threading.Condition) -> None:
        self.state, self.metrics, self.lock = state, metrics, lock
        self._entries: list[Entry] = []
        self._mine = threading.Lock()  # the event thread and the user's both bring the entries up to date

    def entries(self) -> list[Entry]:
        """Every entry so far, oldest first (new changes are taken from the job state)."""
        with self.lock:
            changes = ([self.state.first] if self.state.first else []) + list(self.state.applied)
        with self._mine:
            for applied in changes[len(self._entries):]:
                if self._entries:
                    self._entries[-1].until = applied.iteration
                self._entries.append(Entry(len(self._entries), applied))
            return list(self._entries)

    def entry(self, number: int) -> Entry:
        entries = self.entries()
        if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < len(entries):
            raise ValueError(f"no entry {number!r} in the session's record: entries are 0..{len(entries) - 1} "
                             "(session.history lists them)")
        return entries[number]

    def observe(self, event: dict[str, Any]) -> None:
        """An event: once an iteration of a new plan is in, the plans before it have reported all of theirs, and
        their splits and last spans are kept before the span window rolls past them."""
        if event.get("type") != "iteration":
            return
        entries = self.entries()
        for entry in entries[-2::-1]:  # newest ended first; older ones were kept already
            if entry.kept or entry.until is None or event["iteration"] < entry.until:
                break
            entry.split, entry.last = self._measure(entry)
            entry.kept = True
        for old in entries[:-KEEP]:
            old.last = None  # its row and split stay; its spans go

    def _measure(self, entry: Entry) -> tuple[list[StageTime] | None, Timeline | None]:
        """The entry's split over its last iterations in the span window, and its last iteration's spans."""
        start = entry.applied.iteration
        end = entry.until if entry.until is not None else self.state.iteration
        lo = max(start, end - SPLIT_ITERATIONS)
        window = Timeline(tuple(s for s in self.metrics.timeline() if lo <= s.iteration < end))
        if not len(window):
            return None, None
        newest = max(s.iteration for s in window)
        return breakdown(window), Timeline(tuple(s for s in window if s.iteration == newest))

    def split(self, entry: Entry) -> tuple[list[StageTime] | None, Timeline | None]:
        """An entry's split and last iteration's spans: kept, or measured now for the plan in force."""
        return (entry.split, entry.last) if entry.kept else self._measure(entry)

    def _measured(self, entry: Entry) -> dict[str, Any]:
        """An entry's iterations, median time and samples/s (over its newest ``LOOK_BACK`` iterations), from the
        iteration table's newest rows only; an ended entry's once, then kept (a refresh stays cheap after hours)."""
        if entry.measured is not None:
            return entry.measured
        start = entry.applied.iteration
        end = entry.until if entry.until is not None else self.state.iteration
        lo = max(start, end - LOOK_BACK)
        ran = [r for r in self.metrics.records(last=max(0, self.state.iteration - lo)) if lo <= r["iteration"] < end]
        times = [r["time_s"] for r in ran if r.get("time_s")]
        rates = [r["samples_per_s"] for r in ran if r.get("samples_per_s")]
        done = {"iterations": max(0, end - start) if ran or end == start else 0,
                "median_s": statistics.median(times) if times else None,
                "samples_per_s": statistics.median(rates) if rates else None}
        if entry.kept:  # ended and every iteration of it reported
            entry.measured = done
        return done

    def recent(self, n: int, settle: int) -> list[tuple[float, float]]:
        """The plan in force's newest ``n`` iterations as (end, seconds), oldest first, leaving out its first
        ``settle`` iterations (the migration's pause and the first iteration after it)."""
        entries = self.entries()
        if not entries:
            return []
        lo = entries[-1].applied.iteration + settle
        return [(r.get("end_s") or 0.0, r["time_s"]) for r in self.metrics.records(last=n)
                if r["iteration"] >= lo and r.get("time_s")]

    def rows(self) -> list[dict[str, Any]]:
        """The table's rows (``frame``)."""
        rows = []
        for entry in self.entries():
            a = entry.applied
            measured = self._measured(entry)
            median = measured["median_s"]
            split = self.split(entry)[0]
            rows.append({
                "entry": entry.number, "version": a.version, "source": a.source, "plan": a.plan.describe(),
                "stages": a.plan.stages, "from_iteration": a.iteration, "to_iteration": entry.until, **measured,
                "predicted_s": a.predicted_s, "error": median / a.predicted_s - 1 if median and a.predicted_s else None,
                "bottleneck": bottleneck(split) if split else None, "moves": a.moves, "pause_s": a.pause_s,
            })
        return rows

    def frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.rows(), columns=COLUMNS)

    def compare(self, a: int, b: int) -> Any:
        """Entries ``a`` and ``b`` side by side, a row per stage: each one's measured seconds and shares per part of
        the iteration (``core/cost/breakdown.py``), the bottleneck marked, and its median iteration time."""
        frames = []
        for number in (a, b):
            entry = self.entry(number)
            frame = breakdown_frame(self.split(entry)[0] or [])
            frame["median_s"] = self._measured(entry)["median_s"]
            frames.append(frame.set_index("stage").add_suffix(f"_{number}"))
        return frames[0].join(frames[1], how="outer").reset_index()


COLUMNS = ["entry", "version", "source", "plan", "stages", "from_iteration", "to_iteration", "iterations", "median_s",
           "samples_per_s", "predicted_s", "error", "bottleneck", "moves", "pause_s"]

