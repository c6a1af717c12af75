"""A name kept for one release: it answers with the private value and warns, naming what to use instead."""

from __future__ import annotations

import pytest

from vpipe_lab.core.deprecated import Deprecated


class Job:
    stages = Deprecated("_stages", "job.plan.stages")

    def __init__(self) -> None:
        self._stages = 3


def test_an_old_name_answers_and_says_what_to_use() -> None:
    with pytest.warns(DeprecationWarning, match=r"Job.stages is deprecated and goes in the next release: use "
                                                r"job.plan.stages"):
        assert Job().stages == 3
    assert isinstance(Job.stages, Deprecated)  # on the class: the descriptor itself (help(), dir() show it)
