"""The metrics of an unattended job, written by rank 0's broker into the run directory as it trains.

``metrics.jsonl`` has one JSON object per line: ``{"kind": "iteration", ...}`` for every completed iteration (what
``Session.metrics.iterations`` shows, plus each stage's time and peak memory), ``{"kind": "evaluation", ...}`` and
``{"kind": "plan", ...}`` for plan changes, ``{"kind": "experts", "iteration", "stage", "layer", "tokens", "dropped"}``
per mixture-of-experts layer per iteration (``Session.metrics.expert_records``' rows: tokens each expert received,
tokens dropped over a capacity), ``{"kind": "start", "iteration": ...}`` each time the job (re)starts. A
restarted job first drops the lines of iterations it will train again
(those after the checkpoint it resumes from), so the file reads as one run. ``read(run_dir)`` gives the iterations as
a pandas DataFrame. The same records go to the job's metrics sink (``--log``, see ``telemetry/sinks.py``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from vpipe_lab.telemetry.metrics import IterationParts, evaluation_record, experts_frame
from vpipe_lab.telemetry.sinks import Logger, Sink
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.codec import decode
from vpipe_lab.wire.events import Evaluated, IterationReport, Migrated

log = logging.getLogger(__name__)
METRICS = "metrics.jsonl"
ATTACH = "attach.json"


class RunLog:
    """Collects every stage's reports of an iteration and appends the iteration's line once all are in."""

    def __init__(self, run_dir: Path, stages: int, start: int, sink: Sink | None = None, replicas: int = 1,
                 note: str = "") -> None:
        self.path = run_dir / METRICS
        self.stages, self.workers = stages, stages * replicas
        self.logger = Logger(sink)
        self._parts = IterationParts(stages, replicas)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate(start)
        self._file = open(self.path, "a", encoding="utf-8")
        # the stages it (re)started with, and how it went on when torchrun gave it another number of them
        self._write({"kind": "start", "iteration": start, "stages": stages, **({"note": note} if note else {})})
        if note:
            self.logger.event(start, "restart", note)

    def _truncate(self, start: int) -> None:
        """Keep only what happened before iteration ``start`` (the restart trains the rest again)."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by the kill that caused this restart
                continue
            done = int(row.get("iteration", 0)) + (1 if row.get("kind") == "iteration" else 0)
            if done <= start:
                kept.append(line)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def _write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def observe(self, msg: P.Message) -> None:
        if msg.type not in (P.ITERATION, P.EVALUATED, P.MIGRATED):
            return
        try:
            body = decode(msg)
        except P.ProtocolError as exc:
            log.warning("the run log skipped a malformed %r message: %s", msg.type, exc)
            return
        if isinstance(body, IterationReport):
            done = self._parts.add(body)
            if done is None:
                return
            # Per-stage columns: the first replica's.
            stages = [{"stage": b.stage, "time_s": b.end - b.start, "peak_bytes": b.memory.get("peak")}
                      for b in done.ranks]
            self._write({"kind": "iteration", **done.record, "stages": stages})
            for row in done.experts:
                self._write({"kind": "experts", **row})
            self.logger.iteration(done.record, [{"stage": s["stage"], "peak": s["peak_bytes"]} for s in stages],
                                  done.ranks, done.experts)
        elif isinstance(body, Evaluated) and not body.error:
            record = evaluation_record(body)
            self._write({"kind": "evaluation", **record})
            self.logger.evaluation(record)
        elif isinstance(body, Migrated) and body.stage == 0:
            self._write({"kind": "plan", "iteration": body.iteration, "version": body.version})
            self.logger.event(body.iteration, "plan", f"plan version {body.version}")

    def close(self) -> None:
        self._file.close()
        self.logger.close()


def read(run_dir: str | Path, kind: str = "iteration") -> Any:
    """The run's ``kind`` rows ("iteration", "evaluation", "plan" or "experts") as a pandas DataFrame ("experts":
    as ``Session.metrics.experts``, a row per expert)."""
    import pandas as pd

    rows = []
    for line in (Path(run_dir) / METRICS).read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.pop("kind", None) == kind:
            rows.append(row)
    if kind == "experts":
        return experts_frame(rows)
    return pd.DataFrame(rows)


def write_attach(run_dir: Path, address: str, host: str, key_file: str | None) -> Path:
    """Rank 0 says where it serves clients, so a job script or a person need not guess which node it landed on."""
    path = run_dir / ATTACH
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"address": address, "host": host, "key_file": key_file, "pid": os.getpid()}))
    os.replace(tmp, path)
    return path
