"""A streamed table keeps compact rows, a recent window in memory and the rest on disk, and gives every row back."""

from __future__ import annotations

import gc
import math

import pytest

from vpipe_lab.telemetry.rows import Rows


def test_rows_come_back_as_they_went_in_with_columns_that_appear_later() -> None:
    rows = Rows("t")
    rows.append({"iteration": 0, "loss": 1.5})
    rows.extend([{"iteration": 1, "loss": 1.25, "lr": 0.1}, {"iteration": 2, "loss": math.nan, "lr": None}])
    assert rows.all()[:2] == [{"iteration": 0, "loss": 1.5}, {"iteration": 1, "loss": 1.25, "lr": 0.1}]
    assert math.isnan(rows.all()[2]["loss"]) and rows.all()[2]["lr"] is None
    assert rows.newest()["iteration"] == 2 and [r["iteration"] for r in rows.last(2)] == [1, 2]
    assert len(rows) == 3 and rows.in_memory == 3 and rows.spill_path is None


def test_a_window_keeps_memory_flat_and_writes_the_rest_to_its_own_file() -> None:
    rows = Rows("memory", window=100)
    for it in range(1000):
        rows.extend({"iteration": it, "stage": s, "peak": 1000 * it + s} for s in range(2))
    assert rows.in_memory == 100 and len(rows) == 2000
    path = rows.spill_path
    assert path is not None and path.exists()
    every = rows.all()
    assert [(r["iteration"], r["stage"]) for r in every] == [(it, s) for it in range(1000) for s in range(2)]
    assert every[-1] == {"iteration": 999, "stage": 1, "peak": 999001} and rows.last(1) == every[-1:]
    del rows, every
    gc.collect()
    assert not path.exists()  # the file goes with the table


def test_a_window_must_hold_a_row() -> None:
    with pytest.raises(ValueError, match="window must be a number of rows >= 1"):
        Rows("t", window=0)
