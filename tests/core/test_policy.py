"""Policies: where a layer's activations live, parsed from what users type."""

import pytest

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Policy as PlansPolicy
from vpipe_lab.core.policy import Policy


def test_policy_parse() -> None:
    assert Policy.parse("s") is Policy.SWAP
    assert Policy.parse("Recompute") is Policy.RECOMPUTE
    assert Policy.parse(Policy.KEEP) is Policy.KEEP and str(Policy.KEEP) == "keep"
    with pytest.raises(PlanError, match="unknown policy 'x'"):
        Policy.parse("x")
    assert PlansPolicy is Policy  # plans re-export it
