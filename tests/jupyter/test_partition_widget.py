from __future__ import annotations

import threading
import time
import types

import pytest

from vpipe_lab.core.change import Applied, Change
from vpipe_lab.core.cost.calibration import Calibration
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster
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
    assert "export" in text and "vpipe-handle" in text and '"apply"' in text
    assert (STATIC / "editor_messages.schema.json").exists()  # the message contract Python validates against


def draft(boundaries: list[int], policies: list[str], kind: str = "draft") -> dict[str, object]:
    return {"kind": kind, "boundaries": boundaries, "policies": policies}


def test_preview_follows_the_draft_and_apply_commits() -> None:
    ed, applied = editor()
    try:
        wait_for(lambda: "current" in ed.preview and len(ed.layers) == 8)
        ed.receive(draft([0, 2, 8], ["keep"] * 8))
        wait_for(lambda: ed.preview.get("draft", {}).get("stage_s") and
                 ed.preview["draft"]["stage_s"] != ed.preview["current"]["stage_s"])
        assert ed.draft_boundaries == [0, 2, 8]  # Python owns the draft; the front end reads it back
        # both plans' schedule grids, as torch prints a schedule, and as CSV (1F1B on 2 ranks, 4 micro-batches)
        assert ed.preview["current"]["grid"] == ed.preview["draft"]["grid"]  # the partition moves no action
        assert ed.preview["current"]["grid"].splitlines()[1].split() == ["Step", "0:", "0F0"]
        assert ed.preview["draft"]["grid_csv"].splitlines()[0] == "step,rank 0,rank 1"
        ed.receive(draft([0, 2, 8], ["keep"] * 7 + ["swap"], kind="apply"))
        wait_for(lambda: ed.status.get("state") == "applied")
        assert applied == [Plan((0, 2, 8), ("keep",) * 7 + ("swap",), 4)] and ed.boundaries == [0, 2, 8]
        ed.receive(draft([0, 0, 8], ["keep"] * 8))
        wait_for(lambda: "error" in ed.preview)
        assert "no layers" in ed.preview["error"]
    finally:
        ed.close()


def test_the_schedule_is_chosen_from_the_registry_and_the_draft_cut_to_its_chunks() -> None:
    ed, applied = editor()
    try:
        wait_for(lambda: "current" in ed.preview)
        assert ed.schedule == ed.draft_schedule == "1f1b" and "zbv" in ed.schedules and "dualpipev" in ed.schedules
        ed.receive({**draft([0, 4, 8], ["keep"] * 8), "schedule": "interleaved-1f1b"})  # two chunks per stage
        wait_for(lambda: ed.draft_schedule == "interleaved-1f1b" and ed.preview.get("draft"))
        assert ed.draft_boundaries == [0, 2, 4, 6, 8] and ed.draft_placement == [0, 1, 0, 1]
        ed.receive({**draft([0, 1, 4, 6, 8], ["keep"] * 8), "schedule": "interleaved-1f1b"})  # then a drag
        wait_for(lambda: ed.draft_boundaries == [0, 1, 4, 6, 8])
        ed.receive({**draft([0, 1, 4, 6, 8], ["keep"] * 8, kind="apply"), "schedule": "interleaved-1f1b"})
        wait_for(lambda: ed.status.get("state") == "applied")
        assert applied == [Plan((0, 1, 4, 6, 8), ("keep",) * 8, 4, "interleaved-1f1b", 2)]
        assert ed.schedule == "interleaved-1f1b" and ed.placement == [0, 1, 0, 1]
        ed.receive({**draft([0, 1, 4, 6, 8], ["keep"] * 8), "schedule": "no-such-schedule"})
        wait_for(lambda: "error" in ed.preview)
        assert "unknown schedule 'no-such-schedule'" in ed.preview["error"] and len(applied) == 1
        assert ed.draft_schedule == "interleaved-1f1b"  # the draft stays what it was
    finally:
        ed.close()


def test_edits_from_another_thread_are_safe() -> None:
    """Widget messages may arrive on a subshell thread while a cell runs: observers only queue work."""
    ed, _ = editor()
    try:
        def edit(n: int) -> None:
            for i in range(20):
                ed.receive(draft([0, 4, 8], ["keep"] * 7 + [["swap", "recompute", "keep"][(i + n) % 3]]))
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


def test_messages_that_break_the_contract_change_nothing() -> None:
    ed, applied = editor()
    try:
        wait_for(lambda: "current" in ed.preview)
        for bad in ({"kind": "apply"}, {"kind": "draft", "boundaries": [0, 8], "policies": ["fast"] * 8},
                    {"kind": "launch", "boundaries": [0, 8], "policies": []}, "apply",
                    {"kind": "draft", "boundaries": [0, "4", 8], "policies": ["keep"] * 8}):
            ed.receive(bad)
            assert ed.status["state"] == "error" and "malformed" in ed.status["message"]
        time.sleep(0.2)
        assert applied == [] and ed.draft_boundaries == [0, 4, 8]
    finally:
        ed.close()


def test_the_editor_freezes_when_the_session_ends() -> None:
    ed, applied = editor()
    try:
        wait_for(lambda: "current" in ed.preview)
        ed._on_session_event({"type": "closed", "status": "stopped"})
        wait_for(lambda: ed.status.get("state") == "ended")
        assert "session ended (stopped)" in ed.status["message"]
        ed.receive(draft([0, 2, 8], ["keep"] * 8, kind="apply"))
        time.sleep(0.2)
        assert applied == [] and ed.boundaries == [0, 4, 8] and ed.comm is not None  # still shown, unchanged
    finally:
        ed.close()


def test_the_synced_traits_are_the_declared_ones_and_hold_what_they_declare() -> None:
    """extension/src/traits.ts declares each widget's traits once; the browser's types come from it, and here the
    widget is held to it: the same names, and values that validate (after a preview and an apply too)."""
    import json

    import jsonschema

    schema = json.loads((STATIC / "widget_traits.schema.json").read_text())["$defs"]["PartitionEditor"]
    assert set(PartitionEditor.class_own_traits(sync=True)) == set(schema["properties"])
    ed, _ = editor()
    try:
        wait_for(lambda: "current" in ed.preview)
        jsonschema.validate({name: getattr(ed, name) for name in schema["properties"]}, schema)
        ed.receive(draft([0, 3, 8], ["keep"] * 7 + ["swap"], kind="apply"))
        wait_for(lambda: ed.status.get("state") == "applied")
        jsonschema.validate({name: getattr(ed, name) for name in schema["properties"]}, schema)
    finally:
        ed.close()


def test_the_what_if_view_draws_the_draft_beside_the_running_plan_against_the_users_budget() -> None:
    ed, _ = editor()
    try:
        wait_for(lambda: "current" in ed.preview and ed.what_if.view.timeline)
        assert ed.what_if.view.timeline["layout"]["yaxis"]["ticktext"][0] == "running (simulated) · stage 0"
        ed.receive(draft([0, 1, 8], ["keep"] * 8))
        wait_for(lambda: "draft" in ed.preview and "draft (simulated) · stage 1" in
                 ed.what_if.view.timeline["layout"]["yaxis"]["ticktext"])
        peaks = ed.what_if.view.memory["data"]
        assert peaks[1]["visible"] and len(peaks[1]["y"]) == 2
        assert peaks[2]["y"] == [10**12 / 2**30] * 2  # the line: the cluster's budget, until the user sets one
        assert "draft:" in ed.what_if.view.header["text"]
        ed.what_if.budget.value = 0.001  # about 1 MiB per stage: the draft no longer fits, and the line shows it
        wait_for(lambda: ed.preview.get("draft", {}).get("budget_bytes") == [int(0.001 * 2**30)] * 2)
        assert ed.preview["draft"]["feasible"] is False
        wait_for(lambda: ed.what_if.view.memory["data"][2]["y"] == [int(0.001 * 2**30) / 2**30] * 2)
        bundle = ed._repr_mimebundle_()
        view = bundle[0] if isinstance(bundle, tuple) else bundle
        assert view["application/vnd.jupyter.widget-view+json"]["model_id"] == ed.panel.model_id
    finally:
        ed.close()


def test_the_what_if_prices_the_draft_on_another_shard_count_and_apply_says_it_runs_after_a_restart() -> None:
    """The shard box prices the draft as the cost model prices that mesh (each rank's share of the parameters,
    the global batch split over the shards, the collectives), the same numbers estimate() gives; Apply of a draft on
    another mesh is refused with what to do, and at the job's own count it applies."""
    import dataclasses

    from vpipe_lab.core.cost import scaling
    from vpipe_lab.core.cost.costmodel import estimate

    profile = dataclasses.replace(random_chain(8, seed=4), microbatch_size=8)
    applied: list[Plan] = []
    cluster = Cluster(2, 10**12, 1e9, 1e9)
    ed = PartitionEditor(plan=Plan.from_counts([4, 4], 4), profile=profile, cluster=cluster,
                         on_apply=lambda p: applied.append(p) or 7)
    try:
        wait_for(lambda: "draft" in ed.preview)
        whole = ed.preview["draft"]
        ed.what_if.shards.value = 2
        wait_for(lambda: "at 2 shards per stage (after a restart)" in ed.what_if.view.header.get("text", ""))
        wait_for(lambda: ed.preview["draft"]["peak_bytes"] != whole["peak_bytes"])
        expected = estimate(Plan.from_counts([4, 4], 4).with_mesh(shards=2), scaling.at(profile, 4), cluster)
        assert ed.preview["draft"]["peak_bytes"] == list(expected.peak_bytes)
        assert all(two < one for two, one in zip(expected.peak_bytes, whole["peak_bytes"]))  # a share each
        assert ed.preview["current"] == whole  # the plan in force is priced as it runs
        ed.receive(draft([0, 4, 8], ["keep"] * 8, kind="apply"))
        wait_for(lambda: ed.status.get("state") == "error")
        assert "another mesh runs after a restart" in ed.status["message"] and applied == []
        ed.what_if.shards.value = 1
        ed.receive(draft([0, 3, 8], ["keep"] * 8, kind="apply"))
        wait_for(lambda: ed.status.get("state") == "applied")
        assert applied == [Plan((0, 3, 8), ("keep",) * 8, 4)]
    finally:
        ed.close()


def test_a_draft_and_its_preview_reach_the_browser_in_one_message() -> None:
    """The front end waits for the draft traits and shows the preview that came with them: were they two messages,
    it would show the previous draft's what-if for a moment (a user, or a benchmark, could read it)."""
    ed, _ = editor()
    try:
        wait_for(lambda: "current" in ed.preview and len(ed.layers) == 8)
        sent: list[set[str]] = []
        ed._send = lambda msg, buffers=None: sent.append(set(msg["state"]))  # what would go to the browser
        ed.receive(draft([0, 3, 8], ["keep"] * 8))
        wait_for(lambda: ed.draft_boundaries == [0, 3, 8]
                 and ed.preview["draft"]["stage_s"] != ed.preview["current"]["stage_s"])
        with_draft = [keys for keys in sent if "draft_boundaries" in keys]
        assert with_draft and all("preview" in keys for keys in with_draft)
    finally:
        ed.close()


class _SlowSession:
    """A session whose iterations are longer than the editor waits for a fresh profile."""

    status = "running"
    metrics = types.SimpleNamespace(timeline=lambda last: None)

    def __init__(self) -> None:
        self.asked: list[float | None] = []

    def profile(self, reset: bool = False, timeout: float | None = None) -> None:
        self.asked.append(timeout)
        raise TimeoutError("not every stage answered 'profile' within 2 s")

    record = types.SimpleNamespace(calibration=lambda simulated_s: None, rows=lambda: [])


def test_a_draft_is_previewed_with_the_profile_in_hand_when_no_fresh_one_comes_in_time() -> None:
    ed, _ = editor()
    try:
        wait_for(lambda: "current" in ed.preview and len(ed.layers) == 8)
        slow = _SlowSession()
        ed.session = slow  # type: ignore[assignment]
        ed.receive(draft([0, 3, 8], ["keep"] * 8))
        wait_for(lambda: ed.draft_boundaries == [0, 3, 8])
        assert slow.asked == [ed.fresh_wait_s]  # it asked, waited that long at most, and went on
        assert ed.preview["draft"]["stage_s"] != ed.preview["current"]["stage_s"] and ed.status["state"] != "error"
    finally:
        ed.session = None
        ed.close()


class _DriftingSession:
    """A running session whose calibration the test sets (as the running plan's iterations would move it) and which
    keeps the changes the editor applies; its profile is the one in hand (no fresh one comes)."""

    status = "running"
    metrics = types.SimpleNamespace(timeline=lambda last: None)

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.changes: list[Change] = []
        self.record = types.SimpleNamespace(calibration=self._calibration, rows=lambda: [])

    def _calibration(self, simulated_s: float) -> Calibration:
        return Calibration(measured_s=simulated_s * self.factor, simulated_s=simulated_s, samples=9)

    def profile(self, reset: bool = False, timeout: float | None = None) -> None:
        raise TimeoutError("no fresh profile in this test")

    def change(self, change: Change, **kw: object) -> Applied:
        self.changes.append(change)
        return Applied(plan=change.on(Plan.from_counts([4, 4], 4)), version=len(self.changes), iteration=3)


def test_apply_records_the_what_if_the_page_showed_not_a_newer_one_still_on_its_way() -> None:
    """A re-calibration can reach Python after the page drew its number and before the click arrives: the prediction
    recorded is the one the page names (a number this editor sent), else the newest one sent; never the page's own."""
    ed, _ = editor()
    try:
        wait_for(lambda: "current" in ed.preview and len(ed.layers) == 8)
        session = _DriftingSession(1.0)
        ed.session = session  # type: ignore[assignment]
        ed.receive(draft([0, 3, 8], ["keep"] * 8))
        wait_for(lambda: ed.draft_boundaries == [0, 3, 8] and "draft" in ed.preview)
        wait_for(lambda: ed.preview.get("calibration") is not None)
        seen = ed.preview["draft"]["iteration_s"]  # what the page shows ...
        session.factor = 1.5  # ... as the running plan's iterations move the calibration: Python previews again
        wait_for(lambda: ed.preview["draft"]["iteration_s"] == pytest.approx(1.5 * seen))
        newer = ed.preview["draft"]["iteration_s"]
        ed.receive({**draft([0, 3, 8], ["keep"] * 8, kind="apply"), "shown_s": seen})
        wait_for(lambda: len(session.changes) == 1)
        assert session.changes[0].predicted_s == seen
        for count, shown in enumerate(({}, {"shown_s": 1234.5}), start=2):  # none shown, or one never sent
            ed.receive({**draft([0, 3, 8], ["keep"] * 8, kind="apply"), **shown})
            wait_for(lambda n=count: len(session.changes) == n)  # type: ignore[misc]
            assert session.changes[-1].predicted_s == newer  # the newest one sent
    finally:
        ed.session = None
        ed.close()


def test_a_sharded_job_s_stages_take_their_sharding_from_the_editor_priced_and_applied() -> None:
    """A sharded plan's stages show their sharding; a draft that sets one is priced as estimate() prices that plan
    (a stage that streams holds less than one that holds) and Apply hands it on; a pipeline of whole devices shows
    none, and a message that sets one anyway gets the plan's own refusal, changing nothing."""
    import dataclasses

    from vpipe_lab.core.cost.costmodel import estimate

    profile = dataclasses.replace(random_chain(8, seed=4), microbatch_size=8)
    cluster = Cluster(2, 10**12, 1e9, 1e9)
    plan = Plan.from_counts([4, 4], 4).with_mesh(shards=2)
    applied: list[Plan] = []
    ed = PartitionEditor(plan=plan, profile=profile, cluster=cluster, on_apply=lambda p: applied.append(p) or 7)
    try:
        wait_for(lambda: "current" in ed.preview)
        assert ed.sharding == ed.draft_sharding == ["hold", "hold"]
        ed.receive({**draft([0, 4, 8], ["keep"] * 8), "sharding": ["hold", "stream"]})
        wait_for(lambda: ed.draft_sharding == ["hold", "stream"])
        streamed = plan.with_mesh(sharding=("hold", "stream"))
        assert ed.draft() == streamed
        assert ed.preview["draft"]["peak_bytes"] == list(estimate(streamed, profile, cluster).peak_bytes)
        assert ed.preview["draft"]["peak_bytes"][1] < ed.preview["current"]["peak_bytes"][1]
        ed.receive({**draft([0, 4, 8], ["keep"] * 8, kind="apply"), "sharding": ["hold", "stream"]})
        wait_for(lambda: ed.status.get("state") == "applied")
        assert applied == [streamed] and ed.sharding == ["hold", "stream"]
    finally:
        ed.close()
    whole, nothing = editor()
    try:
        wait_for(lambda: "current" in whole.preview)
        assert whole.sharding == whole.draft_sharding == []
        whole.receive({**draft([0, 4, 8], ["keep"] * 8), "sharding": ["stream", "stream"]})
        wait_for(lambda: "error" in whole.preview)
        assert "this job runs shards=1" in whole.preview["error"] and whole.draft_sharding == []
    finally:
        whole.close()
    assert nothing == []
