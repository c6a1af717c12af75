"""The one count/size check: what passes, and the error naming the value and what it counts."""

import pytest

from vpipe_lab.core import checks
from vpipe_lab.core.errors import PlanError


def test_counts() -> None:
    checks.count(1, "stages")
    checks.count(0, "iterations", 0)
    checks.count(None, "keep", optional=True)
    for bad in (0, -1, 1.0, True, "2", None):
        with pytest.raises(ValueError, match=r"stages must be a whole number >= 1, got "):
            checks.count(bad, "stages")
    with pytest.raises(PlanError, match=r"keep must be a whole number >= 1 or None \(versions to keep\), got 0"):
        checks.count(0, "keep", optional=True, error=PlanError, what="versions to keep")


def test_positive_numbers() -> None:
    checks.positive(0.5, "clip_grad_norm")
    checks.positive(None, "clip_grad_norm", optional=True)
    for bad in (0, -1.0, True, "1", float("nan"), None):
        with pytest.raises(ValueError, match="clip_grad_norm must be a positive number"):
            checks.positive(bad, "clip_grad_norm")
