"""Timelines of pipeline work, measured or simulated: spans per stage, to pandas and to Chrome-trace JSON (Perfetto)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vpipe_lab.core import documents
from vpipe_lab.core.errors import ProfileError

# Appended, never reordered: a worker's iteration report sends a span's kind as its index here.
KINDS = ("forward", "backward", "recompute", "swap_out", "swap_in", "send", "recv", "idle", "migrate", "wgrad",
         "all_gather", "reduce_scatter")
# A sharded stage's collectives over its shards (FSDP2's all-gather of parameters, reduce-scatter of gradients).
SHARD_KINDS = frozenset({"all_gather", "reduce_scatter"})
COMPUTE_KINDS = frozenset({"forward", "backward", "wgrad", "recompute"})
# Work that runs beside the compute stream (copy engines), drawn on a lane of its own.
ASYNC_KINDS = frozenset({"swap_out", "swap_in"})


@dataclass(frozen=True)
class Span:
    """One piece of work: ``kind`` on ``stage`` for ``microbatch`` (and ``layer`` where it is per layer), in pipeline
    ``replica`` (a data-parallel copy of the pipeline; 0 unless the job runs several), for the stage's ``chunk``-th
    virtual stage (0 unless the schedule gives a stage several, as interleaved 1F1B does)."""

    stage: int
    kind: str
    microbatch: int
    layer: int | None
    start_s: float
    end_s: float
    iteration: int = 0
    replica: int = 0
    chunk: int = 0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Timeline:
    """Spans from one or more iterations, on one clock (seconds)."""

    spans: tuple[Span, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "spans", tuple(self.spans))
        for span in self.spans:
            if span.kind not in KINDS:
                raise ProfileError(f"span kind {span.kind!r} is not one of {', '.join(KINDS)}")

    def __iter__(self) -> Iterator[Span]:
        return iter(self.spans)

    def __len__(self) -> int:
        return len(self.spans)

    def __add__(self, other: Timeline) -> Timeline:
        return Timeline(self.spans + other.spans)

    @property
    def stages(self) -> int:
        return 1 + max((s.stage for s in self.spans), default=-1)

    @property
    def chunks(self) -> int:
        """Virtual stages per stage with spans here (at least 1)."""
        return 1 + max((s.chunk for s in self.spans), default=0)

    @property
    def replicas(self) -> int:
        """Pipeline replicas with spans here (at least 1)."""
        return 1 + max((s.replica for s in self.spans), default=0)

    @property
    def start_s(self) -> float:
        return min((s.start_s for s in self.spans), default=0.0)

    @property
    def end_s(self) -> float:
        return max((s.end_s for s in self.spans), default=0.0)

    @property
    def iteration_s(self) -> float:
        """Wall time from the first span's start to the last span's end."""
        return self.end_s - self.start_s

    def select(self, *, stage: int | None = None, kind: str | Iterable[str] | None = None,
               iteration: int | None = None, replica: int | None = None) -> Timeline:
        kinds = {kind} if isinstance(kind, str) else (set(kind) if kind is not None else None)
        return Timeline(tuple(
            s for s in self.spans
            if (stage is None or s.stage == stage) and (kinds is None or s.kind in kinds)
            and (iteration is None or s.iteration == iteration) and (replica is None or s.replica == replica)
        ))

    def shift(self, dt: float) -> Timeline:
        return Timeline(tuple(replace(s, start_s=s.start_s + dt, end_s=s.end_s + dt) for s in self.spans))

    def scaled(self, factor: float) -> Timeline:
        """Every span ``factor`` times as long and as far from the first start (a simulation calibrated to what the
        machine measures: ``core/cost/calibration.py``)."""
        if factor <= 0:
            raise ValueError(f"a timeline cannot be scaled by {factor!r}: give a factor > 0")
        t0 = self.start_s
        return Timeline(tuple(replace(s, start_s=t0 + (s.start_s - t0) * factor, end_s=t0 + (s.end_s - t0) * factor)
                              for s in self.spans))

    def busy_s(self, stage: int, replica: int = 0) -> float:
        """Time the stage's compute stream spends on forward, backward and recompute."""
        return sum(s.duration_s for s in self.spans
                   if s.stage == stage and s.replica == replica and s.kind in COMPUTE_KINDS)

    def step_overhead_s(self) -> float:
        """The runtime's own time per compute step: in each stage's iteration, the time its compute lane is covered
        by no span (between its first and last), over its forward, backward and weight steps (a backward drawn in
        pieces around its layers' rebuilds is one step); the median over stages and iterations (0 without spans)."""
        lanes: dict[tuple[int, int, int], list[Span]] = {}
        for s in self.spans:
            if s.kind not in ASYNC_KINDS and s.kind not in ("idle", "migrate"):
                lanes.setdefault((s.iteration, s.replica, s.stage), []).append(s)
        per_step = []
        for spans in lanes.values():
            steps = len({(s.kind, s.microbatch, s.chunk) for s in spans
                         if s.kind in ("forward", "backward", "wgrad") and s.layer is None})
            if steps:
                window = max(s.end_s for s in spans) - min(s.start_s for s in spans)
                per_step.append(max(0.0, window - sum(s.duration_s for s in spans)) / steps)
        per_step.sort()
        return per_step[len(per_step) // 2] if per_step else 0.0

    def with_idle(self) -> Timeline:
        """Adds ``idle`` spans for the gaps in each stage's compute lane (of every replica) between its first and last
        span."""
        extra: list[Span] = []
        lanes: dict[tuple[int, int], list[Span]] = {}
        for s in self.spans:
            if s.kind not in ASYNC_KINDS and s.kind != "idle":
                lanes.setdefault((s.replica, s.stage), []).append(s)
        for (replica, stage), spans in sorted(lanes.items()):
            cursor = None
            for s in sorted(spans, key=lambda s: s.start_s):
                if cursor is not None and s.start_s > cursor + 1e-12:
                    extra.append(Span(stage, "idle", s.microbatch, None, cursor, s.start_s, s.iteration, replica))
                cursor = s.end_s if cursor is None else max(cursor, s.end_s)
        return Timeline(self.spans + tuple(extra))

    # --- export -------------------------------------------------------------------------------------------------
    def to_records(self) -> list[dict[str, Any]]:
        return [documents.dump(s) for s in self.spans]

    def to_pandas(self) -> Any:
        """A DataFrame with one row per span (needs pandas)."""
        import pandas as pd  # optional dependency: the core itself stays stdlib-only

        columns = ["stage", "kind", "microbatch", "layer", "start_s", "end_s", "iteration", "replica", "chunk"]
        frame = pd.DataFrame(self.to_records(), columns=columns)
        frame["duration_s"] = frame["end_s"] - frame["start_s"]
        return frame

    def to_json(self) -> str:
        return json.dumps({"kind": "timeline", "version": 1, "spans": self.to_records()})

    @classmethod
    def from_records(cls, records: Sequence[dict[str, Any]]) -> Timeline:
        return cls(tuple(documents.load_fields(Span, r, f"spans[{i}]", ProfileError) for i, r in enumerate(records)))

    @classmethod
    def from_json(cls, text: str) -> Timeline:
        doc = json.loads(text)
        return cls.from_records(doc["spans"] if isinstance(doc, dict) else doc)

    def to_chrome_trace(self, name: str = "vpipe_lab") -> dict[str, Any]:
        """Chrome trace-event JSON (opens in Perfetto or chrome://tracing): a process per stage (of each replica),
        compute and copy lanes."""
        events: list[dict[str, Any]] = []
        stages, replicas = self.stages, self.replicas
        for replica in range(replicas):
            for stage in range(stages):
                pid = replica * stages + stage
                name = f"stage {stage}" if replicas == 1 else f"replica {replica} stage {stage}"
                events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "compute"}})
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "copy"}})
        origin = self.start_s
        for s in self.spans:
            label = (f"{s.kind} mb{s.microbatch}" + (f" L{s.layer}" if s.layer is not None else "")
                     + (f" chunk {s.chunk}" if s.chunk else ""))
            events.append({
                "ph": "X", "name": label, "cat": s.kind, "pid": s.replica * stages + s.stage,
                "tid": 1 if s.kind in ASYNC_KINDS else 0,
                "ts": (s.start_s - origin) * 1e6, "dur": max(0.0, s.duration_s) * 1e6,
                "args": {"microbatch": s.microbatch, "layer": s.layer, "iteration": s.iteration, "chunk": s.chunk},
            })
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"source": name}}

    def save_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace()))

    def format_ascii(self, slot_s: float, kinds: Iterable[str] = ("forward", "backward")) -> str:
        """One row per stage, one column per ``slot_s``: F/B and the micro-batch, '..' where the stage waits.

        Meant for unit durations, where it shows a schedule's staircase literally.
        """
        wanted = set(kinds)
        origin = self.start_s
        slots = round(self.iteration_s / slot_s)
        rows = []
        for stage in range(self.stages):
            cells = [".."] * slots
            for s in self.spans:
                if s.stage != stage or s.replica != 0 or s.kind not in wanted:
                    continue
                first = round((s.start_s - origin) / slot_s)
                last = round((s.end_s - origin) / slot_s)
                for c in range(first, last):
                    cells[c] = ("F" if s.kind == "forward" else "B" if s.kind == "backward" else s.kind[0].upper()) + \
                        str(s.microbatch)
            rows.append(f"{stage}: " + " ".join(cells))
        return "\n".join(rows)
