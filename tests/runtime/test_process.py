"""The worker process's command line (its serving is exercised by every integration test that launches workers)."""

from __future__ import annotations

import pytest

from vpipe_lab.runtime.process import _args


def test_arguments() -> None:
    args = _args(["--config", "job.json", "--rank", "3"])
    assert (args.config, args.rank, args.parent_fd) == ("job.json", 3, -1)
    with pytest.raises(SystemExit):
        _args(["--rank", "1"])  # no job spec
