"""The front end's words are Python's: the committed TypeScript is what the generator writes from the registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from vpipe_lab.core import schedules, vocabulary
from vpipe_lab.core.policy import Policy

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_vocabulary_is_pythons() -> None:
    assert (ROOT / "extension" / "src" / "vocabulary.ts").read_text() == vocabulary.typescript()
    words = vocabulary.words()
    assert words["POLICIES"] == [p.value for p in Policy] == ["keep", "swap", "recompute"]
    assert words["SCHEDULES"] == list(schedules.names())[:len(words["SCHEDULES"])] and "dualpipev" in words["SCHEDULES"]


def test_the_generator_writes_a_file_and_refuses_bad_usage(tmp_path: Path) -> None:
    out = tmp_path / "v.ts"
    assert vocabulary.main([str(out)]) == 0 and out.read_text() == vocabulary.typescript()
    with pytest.raises(SystemExit, match="usage"):
        vocabulary.main([])
