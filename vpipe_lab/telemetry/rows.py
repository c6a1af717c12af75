"""A table the controller keeps as it streams in: compact rows, a recent window in memory, the rest on disk.

A row comes in as a dict and is kept as a tuple of its values against the table's shared column list (a dict per row
costs about twice as much). With ``window`` only the newest rows stay in memory; older ones are appended to a
JSON-lines file of the table's own (in the system's temporary directory, removed with the table), so a run of days
keeps its memory flat and still gives every row back.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import weakref
from collections import deque
from collections.abc import Iterable
from itertools import islice
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_MISSING = object()  # a column this row did not have (columns appear as rows bring them)


class Rows:
    """Append-only rows of one table; thread-safe. ``window=None`` keeps every row in memory."""

    def __init__(self, name: str, window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be a number of rows >= 1 or None (keep all), got {window!r}")
        self.name, self.window = name, window
        self._lock = threading.Lock()
        self._columns: list[str] = []
        self._index: dict[str, int] = {}
        self._rows: deque[tuple[Any, ...]] = deque()
        self._spilled = 0
        self._spill: Path | None = None
        self._file: Any = None

    def __len__(self) -> int:
        with self._lock:
            return self._spilled + len(self._rows)

    @property
    def in_memory(self) -> int:
        """Rows held in memory now (at most ``window``)."""
        with self._lock:
            return len(self._rows)

    @property
    def spill_path(self) -> Path | None:
        """The file older rows went to (None while every row fits the window)."""
        return self._spill

    def append(self, row: dict[str, Any]) -> None:
        self.extend((row,))

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        with self._lock:
            for row in rows:
                for key in row:
                    if key not in self._index:
                        self._index[key] = len(self._columns)
                        self._columns.append(key)
                self._rows.append(tuple(row.get(c, _MISSING) for c in self._columns))
            if self.window is not None and len(self._rows) > self.window:
                self._write_out(len(self._rows) - self.window)

    def newest(self) -> dict[str, Any] | None:
        with self._lock:
            return self._as_dict(self._rows[-1]) if self._rows else None

    def last(self, count: int) -> list[dict[str, Any]]:
        """The newest ``count`` rows in memory, oldest first, without copying the rest."""
        with self._lock:
            return [self._as_dict(r) for r in list(islice(reversed(self._rows), count))[::-1]]

    def all(self) -> list[dict[str, Any]]:
        """Every row, oldest first: those written out (read back from disk) and those in memory."""
        with self._lock:
            held = [self._as_dict(r) for r in self._rows]
            if self._file is not None:
                self._file.flush()
            spill = self._spill
        if spill is None:
            return held
        with open(spill, encoding="utf-8") as fh:
            older = [json.loads(line) for line in fh]
        return older + held

    def _as_dict(self, values: tuple[Any, ...]) -> dict[str, Any]:
        return {c: v for c, v in zip(self._columns, values) if v is not _MISSING}

    def _write_out(self, count: int) -> None:
        """Move the ``count`` oldest rows to the spill file (under the lock)."""
        if self._file is None:
            fd, name = tempfile.mkstemp(prefix=f"vpipe-lab-{self.name}-", suffix=".jsonl")
            self._spill = Path(name)
            self._file = os.fdopen(fd, "w", encoding="utf-8")
            # The file lives as long as the table: removed when the table is collected or the process ends.
            weakref.finalize(self, _remove, self._file, self._spill)
        lines = []
        for _ in range(count):
            lines.append(json.dumps(self._as_dict(self._rows.popleft()), default=_plain))
        self._file.write("\n".join(lines) + "\n")
        self._spilled += count


def _plain(value: Any) -> Any:
    """What JSON cannot write as it is (a numpy number from a user's sink, say): its Python value or its text."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


def _remove(file: Any, path: Path) -> None:
    try:
        file.close()
    finally:
        path.unlink(missing_ok=True)
