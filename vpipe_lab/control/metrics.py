"""What the workers report, kept on the controller: iterations, spans (a rolling window) and memory per stage."""

from __future__ import annotations

import threading
from collections import deque
from itertools import islice
from typing import Any

from vpipe_lab.core.timeline import KINDS, Span, Timeline


class Metrics:
    """Thread-safe store; ``iterations``, ``spans`` and ``memory`` are pandas DataFrames built on access."""

    def __init__(self, span_window: int = 50, max_rows: int = 200_000) -> None:
        self._lock = threading.Lock()
        self._iterations: deque[dict[str, Any]] = deque(maxlen=max_rows)
        self._memory: deque[dict[str, Any]] = deque(maxlen=max_rows)
        self._spans: deque[tuple[int, list[Span]]] = deque(maxlen=span_window)
        self._latest_memory: list[dict[str, Any]] = []

    def add(self, iteration: dict[str, Any], spans: list[Span], memory: list[dict[str, Any]]) -> None:
        with self._lock:
            self._iterations.append(iteration)
            self._memory.extend(memory)
            self._latest_memory = memory
            if spans:
                self._spans.append((iteration["iteration"], spans))

    def add_spans(self, spans: list[Span]) -> None:
        """Spans outside an iteration (migrations), kept with the iteration they precede."""
        with self._lock:
            self._spans.append((spans[0].iteration if spans else -1, spans))

    def records(self, last: int | None = None) -> list[dict[str, Any]]:
        """Iteration records, oldest first; ``last`` takes only the newest ones without copying the rest."""
        with self._lock:
            if last is None:
                return list(self._iterations)
            return list(islice(reversed(self._iterations), last))[::-1]

    def memory_records(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._memory)

    def latest_memory(self) -> list[dict[str, Any]]:
        """The per-stage memory rows of the newest iteration."""
        with self._lock:
            return list(self._latest_memory)

    def latest(self) -> dict[str, Any] | None:
        with self._lock:
            return self._iterations[-1] if self._iterations else None

    def timeline(self, last: int | None = None) -> Timeline:
        """Measured spans of the last ``last`` iterations kept (all kept ones by default), on one clock."""
        with self._lock:
            chunks = list(self._spans)
        if last:
            # The last `last` iterations, with the migrations that preceded them (kept under the same number).
            wanted = set(sorted({it for it, _ in chunks})[-last:])
            chunks = [c for c in chunks if c[0] in wanted]
        return Timeline(tuple(s for _, spans in chunks for s in spans))

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


def spans_from_wire(stage: int, iteration: int, rows: list[list[Any]]) -> list[Span]:
    return [Span(stage, KINDS[k], mb, None if layer < 0 else layer, s, e, iteration) for k, mb, layer, s, e in rows]
