from __future__ import annotations

import threading
import time

import pytest

from vpipe_lab.core.model import Cluster, Plan
from vpipe_lab.core.workloads import random_chain
from vpipe_lab.jupyter.partition_widget import STATIC, PartitionEditor


def wait_for(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cond()


def editor(**kw):  # type: ignore[no-untyped-def]
    profile = random_chain(8, seed=4)
    applied: list[Plan] = []
    ed = PartitionEditor(plan=Plan.from_counts([4, 4], 4), profile=profile,
                         cluster=Cluster(2, 10**12, 1e9, 1e9), on_apply=lambda p: applied.append(p) or 7, **kw)
    return ed, applied


def test_the_bundle_ships_in_the_package() -> None:
    text = (STATIC / "partition.js").read_text()
    assert "export" in text and "vpipe-handle" in text and "apply_count" in text


def test_preview_follows_the_draft_and_apply_commits() -> None:
    ed, applied = editor()
    try:
        wait_for(lambda: "current" in ed.preview and len(ed.layers) == 8)
        ed.draft_boundaries = [0, 2, 8]
        wait_for(lambda: ed.preview.get("draft", {}).get("stage_s") and
                 ed.preview["draft"]["stage_s"] != ed.preview["current"]["stage_s"])
        ed.apply_count += 1
        wait_for(lambda: ed.status.get("state") == "applied")
        assert applied == [Plan((0, 2, 8), ("keep",) * 8, 4)] and ed.boundaries == [0, 2, 8]
        ed.draft_boundaries = [0, 0, 8]
        wait_for(lambda: "error" in ed.preview)
        assert "no layers" in ed.preview["error"]
    finally:
        ed.close()


def test_edits_from_another_thread_are_safe() -> None:
    """Widget messages may arrive on a subshell thread while a cell runs: observers only queue work."""
    ed, _ = editor()
    try:
        def edit(n: int) -> None:
            for i in range(20):
                ed.draft_policies = ["keep"] * 7 + [["swap", "recompute", "keep"][(i + n) % 3]]
        threads = [threading.Thread(target=edit, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        wait_for(lambda: ed._work.empty())
        time.sleep(0.2)
        assert ed.preview.get("draft") is not None and ed.status.get("state") != "error"
    finally:
        ed.close()


def test_needs_a_session_or_what_to_preview() -> None:
    with pytest.raises(ValueError, match="needs a session"):
        PartitionEditor(plan=Plan.from_counts([1, 1], 1))
