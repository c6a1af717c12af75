"""The planning methods as registry entries: the names the CLI and magics offer, and what each one decides."""

import pytest

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Policy
from vpipe_lab.core.planning.methods import METHODS, get


def test_every_method_is_an_entry_with_what_the_planner_reads() -> None:
    assert METHODS == ("uniform", "balanced", "gpipe", "pipedream", "pipedream-flush", "vpipe", "optimal")
    assert get("gpipe").policy is Policy.RECOMPUTE and get("gpipe").refuses_overflow
    assert get("pipedream").schedule == "pipedream" and get("pipedream-flush").schedule is None
    assert not get("pipedream").swaps and get("vpipe").swaps and get("optimal").exact
    assert {get(m).partition for m in METHODS} == {"uniform", "balanced", "bottleneck", "vpipe"}


def test_an_unknown_method_names_the_known_ones() -> None:
    with pytest.raises(PlanError, match="unknown planning method 'fast': use one of uniform, balanced, gpipe"):
        get("fast")
