"""What the workers report, kept on the controller: iterations, spans (a rolling window) and memory per stage.

Memory stays flat over a run of days: spans are a window of recent iterations; the iteration table is kept whole but
compact (a tuple per row, ``telemetry/rows.py``); the per-stage memory, replica and evaluation tables keep a recent
window in memory and write the rest to a file of their own, read back when the whole table is asked for."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vpipe_lab.core.cost.breakdown import PARTS, StageTime, bottleneck, breakdown, by_chunk
from vpipe_lab.core.cost.critical_path import CriticalPath, critical_path
from vpipe_lab.core.timeline import KINDS, Span, Timeline
from vpipe_lab.telemetry.rows import Rows
from vpipe_lab.wire.events import Evaluated, IterationReport


class Metrics:
    """Thread-safe store; ``iterations``, ``spans`` and ``memory`` are pandas DataFrames built on access."""

    def __init__(self, span_window: int = 50, window: int = 4096) -> None:
        self._lock = threading.Lock()
        self._iterations = Rows("iterations")  # what users read most: every row, compact
        self._memory = Rows("memory", window)  # a row per stage per iteration: the newest in memory
        self._spans: deque[tuple[int, list[Span]]] = deque(maxlen=span_window)
        self._latest_memory: list[dict[str, Any]] = []
        self._evaluations = Rows("evaluations", window)
        self._replicas = Rows("replicas", window)
        self._experts = Rows("experts", window)  # a row per MoE layer per iteration: tokens per expert
        self._expert_rows = 0  # rows an iteration adds (its MoE layers): the newest iterations are that many rows
        self._restarts: list[Any] = []  # control/workers/restarts.Restart, read as dicts

    def add_restart(self, restart: Any) -> None:
        """A restart (an object with ``to_dict()``: it is completed after it is added, with the replay's check)."""
        with self._lock:
            self._restarts.append(restart)

    def restart_records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.to_dict() for r in self._restarts]

    @property
    def restarts(self) -> Any:
        """Each restart of a job launched with ``max_restarts``: when, which stage failed and why, the iteration it went
        back to, iterations replayed, seconds lost, and how far the replayed losses were from the first run's."""
        import pandas as pd

        rows = self.restart_records()
        return pd.DataFrame(rows, columns=None if rows else ["number", "time", "stage", "cause", "snapshot",
                                                             "replayed", "seconds", "loss_diff"])

    def add_replicas(self, rows: list[dict[str, Any]]) -> None:
        self._replicas.extend(rows)

    @property
    def replicas(self) -> Any:
        """With ``replicas=R``: each pipeline replica's loss, samples and time per iteration (``iterations`` holds
        the totals)."""
        import pandas as pd

        return pd.DataFrame(self._replicas.all())

    def add_evaluation(self, record: dict[str, Any]) -> None:
        self._evaluations.append(record)

    def evaluation_records(self, last: int | None = None) -> list[dict[str, Any]]:
        """Evaluation rows, oldest first (``last``: only the newest ones)."""
        return self._evaluations.all() if last is None else self._evaluations.last(last)

    @property
    def evaluations(self) -> Any:
        """Evaluation passes: the iteration they ran at (after that many steps), mean loss, batches, seconds."""
        import pandas as pd

        rows = self._evaluations.all()
        return pd.DataFrame(rows, columns=["iteration", "loss", "batches", "seconds"] if not rows else None)

    def add(self, iteration: dict[str, Any], spans: list[Span], memory: list[dict[str, Any]],
            experts: list[dict[str, Any]] | None = None) -> None:
        if experts:
            self._experts.extend(experts)
            self._expert_rows = len(experts)
        self._iterations.append(iteration)
        self._memory.extend(memory)
        with self._lock:
            self._latest_memory = memory
            if spans:
                self._spans.append((iteration["iteration"], spans))

    def add_spans(self, spans: list[Span]) -> None:
        """Spans outside an iteration (migrations), kept with the iteration they precede."""
        with self._lock:
            self._spans.append((spans[0].iteration if spans else -1, spans))

    def records(self, last: int | None = None) -> list[dict[str, Any]]:
        """Iteration records, oldest first; ``last`` takes only the newest ones without copying the rest."""
        return self._iterations.all() if last is None else self._iterations.last(last)

    def memory_records(self) -> list[dict[str, Any]]:
        """Every per-stage memory row, oldest first (the older ones read back from their file)."""
        return self._memory.all()

    def latest_memory(self) -> list[dict[str, Any]]:
        """The per-stage memory rows of the newest iteration."""
        with self._lock:
            return list(self._latest_memory)

    def latest(self) -> dict[str, Any] | None:
        return self._iterations.newest()

    def microbatch_size(self, replicas: int = 1) -> int:
        """Samples per micro-batch (per replica) in the newest iteration; 0 before the first."""
        latest = self.latest()
        if not latest or not latest.get("samples") or not latest.get("microbatches"):
            return 0
        return int(latest["samples"]) // (int(latest["microbatches"]) * replicas)

    def timeline(self, last: int | None = None) -> Timeline:
        """Measured spans of the last ``last`` iterations kept (all kept ones by default), on one clock."""
        with self._lock:
            chunks = list(self._spans)
        if last:
            # The last `last` iterations, with the migrations that preceded them (kept under the same number).
            wanted = set(sorted({it for it, _ in chunks})[-last:])
            chunks = [c for c in chunks if c[0] in wanted]
        return Timeline(tuple(s for _, spans in chunks for s in spans))

    def iteration_gap_s(self, last: int = 20) -> float:
        """The median time from one iteration's end to the next one's start over the last ``last`` consecutive pairs:
        the optimizer step and the boundary between iterations, which an iteration's own span leaves out (0 before two
        iterations ran). A pause between two iterations is one long gap, which the median ignores."""
        spans = {r["iteration"]: (r["start_s"], r["end_s"]) for r in self._iterations.last(last + 1)}
        gaps = sorted(spans[i + 1][0] - spans[i][1] for i in sorted(spans)[-last - 1:] if i + 1 in spans)
        return max(0.0, gaps[len(gaps) // 2]) if gaps else 0.0

    def breakdown(self, last: int = 10, chunks: bool = False) -> Any:
        """Where each stage's time went over the last ``last`` iterations with spans (mean seconds per iteration and
        shares: compute, recompute, swap, transfer (the wire), bubble (waiting, for a neighbour's work too); the
        stage's own time on the critical path and the bottleneck; ``core/cost/breakdown.py``), a DataFrame by stage; with
        ``chunks``, a row per (stage, chunk) of the work each chunk takes (virtual stages: interleaved, ZBV)."""
        timeline = self.timeline(last)
        times = breakdown(timeline)
        return chunk_frame(timeline, times) if chunks else breakdown_frame(times)

    def critical_path(self, iteration: int | None = None) -> CriticalPath:
        """The chain of spans that decided when ``iteration`` (default: the newest kept) ended, walked back from its
        last span (``core/cost/critical_path.py``): ``.spans``, ``.seconds``, ``.stages()``, ``.share(stage=...)``."""
        return critical_path(self.timeline(), iteration)

    @property
    def iterations(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.records())

    @property
    def memory(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.memory_records())

    @property
    def spans(self) -> Any:
        return self.timeline().to_pandas()

    def expert_records(self, iterations: int | None = None) -> list[dict[str, Any]]:
        """Per MoE layer per iteration: ``iteration``, ``stage``, ``layer`` (its module), ``tokens`` (per expert)
        and ``dropped`` (per expert, None without a capacity); oldest first, ``iterations``: only the newest
        iterations' rows (read without copying the rest)."""
        if iterations is None:
            return self._experts.all()
        rows = self._experts.last(iterations * self._expert_rows)
        newest = {r["iteration"] for r in rows}
        keep = set(sorted(newest)[-iterations:])
        return [r for r in rows if r["iteration"] in keep]

    @property
    def experts(self) -> Any:
        """The tokens each expert of each mixture-of-experts layer received per iteration (all replicas together;
        a token routed to k experts counts for each): a row per (iteration, layer, expert) with its ``stage``,
        ``tokens``, its ``share`` of the layer's picks and ``dropped`` (tokens over the layer's capacity; NaN where
        the layer has none). Empty for a model without MoE layers."""
        return experts_frame(self.expert_records())


def experts_frame(rows: list[dict[str, Any]]) -> Any:
    """``Metrics.experts`` from ``expert_records`` rows."""
    import pandas as pd

    out = []
    for r in rows:
        total = sum(r["tokens"]) or 1
        dropped = r.get("dropped")
        out += [(r["iteration"], r["stage"], r["layer"], e, n, n / total,
                 float("nan") if dropped is None else dropped[e]) for e, n in enumerate(r["tokens"])]
    return pd.DataFrame(out, columns=["iteration", "stage", "layer", "expert", "tokens", "share", "dropped"])


def expert_rows(iteration: int, parts: list[IterationReport]) -> list[dict[str, Any]]:
    """One iteration's ``expert_records`` rows from every rank's report, each layer's counts summed over the
    pipeline replicas, in the order the stages run the layers."""
    rows: dict[str, dict[str, Any]] = {}
    for body in sorted(parts, key=lambda b: (b.stage, b.replica)):
        for layer, got in (body.experts or {}).items():
            row = rows.get(layer)
            if row is None:
                rows[layer] = {"iteration": iteration, "stage": body.stage, "layer": layer,
                               "tokens": list(got["tokens"]), "dropped": got.get("dropped")}
                continue
            row["tokens"] = [a + b for a, b in zip(row["tokens"], got["tokens"])]
            if row["dropped"] is not None and got.get("dropped") is not None:
                row["dropped"] = [a + b for a, b in zip(row["dropped"], got["dropped"])]
    return list(rows.values())


def breakdown_frame(times: list[StageTime], prefix: str = "") -> Any:
    """StageTimes as a DataFrame: a row per stage, each part's seconds and share, the stage's own seconds on the
    critical path, the bottleneck (the stage the critical path is most of) marked."""
    import pandas as pd

    worst = bottleneck(times)
    columns = ["stage", f"{prefix}iteration_s", *(f"{prefix}{p}_s" for p in PARTS),
               *(f"{prefix}{p}_share" for p in PARTS), f"{prefix}critical_s", f"{prefix}bottleneck"]
    return pd.DataFrame([[t.stage, t.iteration_s, *(t.seconds(p) for p in PARTS), *(t.share(p) for p in PARTS),
                          t.critical_s, t.stage == worst] for t in times], columns=columns)


def chunk_frame(timeline: Timeline, stages: list[StageTime], prefix: str = "") -> Any:
    """Each chunk's work per iteration (``core/cost/breakdown.by_chunk``) as a DataFrame, a row per (stage, chunk):
    each part's seconds and its share of the stage's iteration (``stages``: the same timeline's ``breakdown``)."""
    import pandas as pd

    window = {t.stage: t.iteration_s for t in stages}
    work = [p for p in PARTS if p != "bubble"]
    return pd.DataFrame([[c.stage, c.chunk, *(c.seconds(p) for p in work),
                          *(c.seconds(p) / window[c.stage] if window.get(c.stage) else 0.0 for p in work)]
                         for c in by_chunk(timeline)],
                        columns=["stage", "chunk", *(f"{prefix}{p}_s" for p in work),
                                 *(f"{prefix}{p}_share" for p in work)])


def spans_from_wire(stage: int, iteration: int, rows: list[tuple[int, int, int, float, float, int]],
                    replica: int = 0) -> list[Span]:
    return [Span(stage, KINDS[k], mb, None if layer < 0 else layer, s, e, iteration, replica, chunk)
            for k, mb, layer, s, e, chunk in rows]


def combine(iteration: int, parts: list[IterationReport]) -> dict[str, Any]:
    """One iteration's record from every rank's report (any order; several pipeline replicas with ``replicas=R``):
    the batch's mean loss over every replica's loss stage (the reports with losses: the last stage, or stage 0 under
    ZBV; each micro-batch's mean counted by its samples, so a short
    last batch's uneven micro-batches give the full-batch mean), the time from the first start to the last end,
    throughput over all replicas, and what the step did (global gradient norm, learning rate, fp16 loss scale,
    whether an overflow or a non-finite loss skipped it)."""
    start, end = min(b.start for b in parts), max(b.end for b in parts)
    firsts = [b for b in parts if b.stage == 0]
    first = min(firsts, key=lambda b: b.replica)
    samples = [b.samples for b in firsts]
    record: dict[str, Any] = {
        "iteration": iteration, "loss": batch_loss([b for b in parts if b.losses]),
        "time_s": end - start, "start_s": start, "end_s": end,
        "samples": sum(s for s in samples if s) if all(samples) else None, "microbatches": first.microbatches,
        "plan_version": first.plan_version, "grad_norm": first.grad_norm, "lr": first.lr,
    }
    if first.loss_scale is not None:
        record["loss_scale"] = first.loss_scale
    if first.loss_scale is not None or first.skipped:  # an fp16 overflow, or a non-finite loss under nonfinite="skip"
        record["skipped"] = bool(first.skipped)
    if record["samples"]:
        record["samples_per_s"] = record["samples"] / record["time_s"] if record["time_s"] > 0 else float("nan")
    return record


def batch_loss(lasts: list[IterationReport]) -> float:
    """The mean loss of the loss stages' micro-batches, each counted by its samples (``sizes``; equal without them);
    where the losses are shares of the batch's loss (``loss_sum``: labels with ignored positions, normalised by the
    batch's count of items), their sum, averaged over the replicas."""
    shares = [sum(body.losses) for body in lasts if body.loss_sum]
    if shares:
        return sum(shares) / len(shares)
    total = weight = 0.0
    for body in lasts:
        sizes = body.sizes or []
        for i, value in enumerate(body.losses):
            w = float(sizes[i]) if len(sizes) == len(body.losses) else 1.0
            total, weight = total + w * value, weight + w
    return total / weight if weight else float("nan")


def per_replica(iteration: int, parts: list[IterationReport]) -> list[dict[str, Any]]:
    """Each pipeline replica's own loss, samples and time in one iteration (``Metrics.replicas``)."""
    rows = []
    for replica in sorted({b.replica for b in parts}):
        mine = [b for b in parts if b.replica == replica]
        first = min(mine, key=lambda b: b.stage)
        losses = [b for b in mine if b.losses]  # the loss stage's report
        rows.append({"iteration": iteration, "replica": replica, "loss": batch_loss(losses), "samples": first.samples,
                     "time_s": max(b.end for b in mine) - min(b.start for b in mine)})
    return rows


def evaluation_record(body: Evaluated) -> dict[str, Any]:
    """The row an evaluation adds to ``Metrics.evaluations`` (and the run log)."""
    return {"iteration": body.iteration, "loss": body.loss, "batches": body.batches, "seconds": body.seconds}


@dataclass(frozen=True)
class Iteration:
    """One iteration once every rank reported it: its record, every replica's spans and memory per stage (what
    timelines and memory charts show; each row and span says its replica), each replica's own row (several replicas
    only) and the first replica's raw per-stage reports."""

    iteration: int
    record: dict[str, Any]
    spans: list[Span]
    memory: list[dict[str, Any]]
    replicas: list[dict[str, Any]]
    ranks: list[IterationReport]
    experts: list[dict[str, Any]] = field(default_factory=list)  # Metrics.expert_records rows


class IterationParts:
    """Collects the per-rank ITERATION reports until an iteration is complete (the Session and the run log share it)."""

    def __init__(self, stages: int, replicas: int = 1) -> None:
        self.stages, self.replicas = stages, replicas
        self._partial: dict[int, dict[int, IterationReport]] = {}

    def add(self, body: IterationReport) -> Iteration | None:
        """Keep one rank's report; the complete iteration once every rank has reported it, else None."""
        it = body.iteration
        parts = self._partial.setdefault(it, {})
        parts[body.replica * self.stages + body.stage] = body
        if len(parts) < self.stages * self.replicas:
            return None
        del self._partial[it]
        everyone = [parts[key] for key in sorted(parts)]  # replica-major, stage-minor
        ranks = everyone[:self.stages]
        spans = [s for b in everyone for s in spans_from_wire(b.stage, it, b.spans, b.replica)]
        memory = [{"iteration": it, "stage": b.stage, "replica": b.replica, **b.memory} for b in everyone]
        return Iteration(it, combine(it, everyone), spans, memory,
                         per_replica(it, everyone) if self.replicas > 1 else [], ranks, expert_rows(it, everyone))
