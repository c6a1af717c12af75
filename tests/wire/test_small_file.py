"""Small files from others are read bounded: a regular file up to its limit, anything else refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vpipe_lab.wire import small_file


def test_a_small_file_reads_and_anything_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text('{"a": 1}')
    assert small_file.read_text(tmp_path / "plan.json", "the plan") == '{"a": 1}'
    (tmp_path / "exact").write_bytes(b"x" * 64)
    assert len(small_file.read_text(tmp_path / "exact", "it", limit=64)) == 64
    with pytest.raises(small_file.TooLarge, match="larger than"):
        small_file.read_text(tmp_path / "exact", "it", limit=63)
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(small_file.TooLarge, match=r"the plan .*zero' is not a regular file"):
        small_file.read_text(tmp_path / "zero", "the plan")
    os.mkfifo(tmp_path / "fifo")  # opening it would block until a writer came
    with pytest.raises(small_file.TooLarge, match="not a regular file"):
        small_file.read_text(tmp_path / "fifo", "the plan")
    with pytest.raises(FileNotFoundError):
        small_file.read_text(tmp_path / "missing", "the plan")
