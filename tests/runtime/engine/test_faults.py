"""Fault injection for the fault tests (runtime/engine/faults.py): what ``VPIPE_LAB_FAULT`` says, where it fires, and
that under torchrun it fires in the job's first attempt only."""

from __future__ import annotations

import pytest

from vpipe_lab.runtime.engine import faults


def test_the_variable_names_a_point_a_rank_how_and_from_which_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert faults.parse("") is None
    assert faults.parse("forward:1:kill@7") == faults.Fault("forward", 1, "kill", 7)
    assert faults.parse("save:0") == faults.Fault("save", 0, "exit", 0)
    monkeypatch.setenv("VPIPE_LAB_FAULT", "migrate:2:hang")
    assert faults.parse() == faults.Fault("migrate", 2, "hang", 0)
    fault = faults.Fault("forward", 1, "exit", 7)
    for point, rank, iteration in (("save", 1, 9), ("forward", 0, 9), ("forward", 1, 6)):
        faults.hit(fault, point, rank, iteration)  # another point, rank or an earlier iteration: nothing happens


def test_under_torchrun_only_the_first_attempt_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VPIPE_LAB_FAULT", "forward:1@10")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert faults.parse() == faults.Fault("forward", 1, "exit", 10)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's restart of the job: the crash is behind it
    assert faults.parse() is None
