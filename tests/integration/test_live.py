"""Live reconfiguration: plan changes at an agreed iteration, live layer migration, save/resume, failures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import vpipe_lab
from vpipe_lab import InfeasiblePlan, Plan, PlanError
from vpipe_lab.control.errors import WorkerError
from vpipe_lab.core import schedules
from vpipe_lab.examples import mlp
from vpipe_lab.wire.checkpoint_format import resolve

pytestmark = pytest.mark.slow

K3 = Plan((0, 4, 7, 10), ("keep",) * 10, 4, "1f1b")


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """Six iterations on three stages, no reconfiguration."""
    with vpipe_lab.launch("mlp", stages=3, microbatches=4, plan=K3, device="cpu", timeout=60) as s:
        s.run(6)
        s.wait(timeout=120)
        return s.state_dict(), list(s.metrics.iterations["loss"])


def test_migrations_leave_training_bit_for_bit_unchanged(reference: tuple[dict, list]) -> None:  # type: ignore[type-arg]
    expected, losses = reference
    with vpipe_lab.launch("mlp", stages=3, microbatches=4, plan=K3, device="cpu", timeout=60) as s:
        s.run(2)
        s.wait(timeout=60)
        # Several layers across several stages: 4,5,6 leave stage 1 for stage 0; 7 joins stage 1.
        at = s.set_partition((0, 7, 8, 10))
        assert at == 2 and s.plan.boundaries == (0, 7, 8, 10)
        assert s.last_migration["moves"] == 4 and s.last_migration["moved_bytes"] > 0
        s.run(2)
        s.wait(timeout=60)
        # Layers travel back and further: 1..6 to stage 1 and 2, stage 2 takes 5 layers.
        assert s.set_partition((0, 1, 5, 10)) == 4
        s.run(2)
        s.wait(timeout=60)
        got = s.state_dict()
        frame = s.metrics.iterations
        migrate_spans = [sp for sp in s.metrics.timeline() if sp.kind == "migrate"]
    assert list(frame["plan_version"]) == [0, 0, 1, 1, 2, 2]
    assert list(frame["loss"]) == losses  # exactly, not approximately
    assert list(got) == list(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    assert {sp.stage for sp in migrate_spans} == {0, 1, 2}


def test_save_and_resume_onto_another_partition(reference: tuple[dict, list], tmp_path: Path) -> None:  # type: ignore[type-arg]
    expected, losses = reference
    with vpipe_lab.launch("mlp", stages=3, microbatches=4, plan=K3, device="cpu", timeout=60) as s:
        s.run(3)
        s.wait(timeout=60)
        first = resolve(s.save(tmp_path / "ckpt"))
        path = s.save(tmp_path / "ckpt", keep=1)  # a new version; the first goes once the second is complete
    version = resolve(path)
    assert version != first and not first.exists()
    assert (version / "manifest.json").exists() and (version / ".metadata").exists()  # a DCP checkpoint
    assert len(list(version.glob("__*_*.distcp"))) == 3  # each of the three stages wrote its own units
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", resume=path, timeout=60) as s:
        assert s.iteration == 3 and s.plan.stages == 2
        s.run(3)
        s.wait(timeout=60)
        got = s.state_dict()
        resumed_losses = list(s.metrics.iterations["loss"])
    assert resumed_losses == losses[3:]
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_invalid_or_oversized_plans_change_nothing() -> None:
    budgets = [160 << 20, 16 << 20]  # stage 1 has little room to take more layers
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", memory_budget=budgets, timeout=60) as s:
        s.run(2)
        s.wait(timeout=60)
        before = s.plan
        with pytest.raises(PlanError, match="must start at 0"):
            s.apply(before.with_boundaries((1, 5, 10)))
        with pytest.raises(PlanError, match="layer 42 does not exist"):
            s.set_policy({42: "swap"})
        big = before.with_boundaries((0, 1, 10))  # stage 1 would take the wide layers (~100 MB with SGD momentum)
        with pytest.raises(InfeasiblePlan, match="stage 1 would need"):
            s.apply(big)
        with pytest.raises(InfeasiblePlan, match="refused"):
            s.apply(big, force=True)  # the receiving stage checks its memory itself before anything moves
        assert s.plan == before and s.plan_version == 0
        s.run(2)
        s.wait(timeout=60)  # training goes on
        assert list(s.metrics.iterations["plan_version"]) == [0, 0, 0, 0]


@pytest.mark.parametrize("fault", ["migrate:0", "migrate:1:kill"])
def test_a_worker_dying_during_a_migration_loses_nothing(fault: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 0 exits halfway through sending its layers; stage 1 is SIGKILLed right after receiving one."""
    monkeypatch.setenv("VPIPE_LAB_FAULT", fault)
    s = vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=30)
    try:
        s.run(3)
        s.wait(timeout=60)
        before = s.state_dict()
        with pytest.raises(WorkerError) as err:
            s.set_partition((0, 3, 10))
        assert err.value.stage == int(fault.split(":")[1]) and err.value.checkpoint and "resume" in str(err.value)
        checkpoint = err.value.checkpoint
    finally:
        s.stop()
    monkeypatch.delenv("VPIPE_LAB_FAULT")
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", resume=checkpoint, timeout=60) as r:
        assert r.iteration == 3 and r.plan.boundaries == (0, 5, 10)  # the plan from before the migration
        after = r.state_dict()
    for key in before:
        assert torch.equal(after[key], before[key]), key


def test_replan_and_automatic_replanning_rebalance_the_uneven_mlp() -> None:
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60) as s:  # uniform: [0:5][5:10]
        s.run(3)
        s.wait(timeout=60)
        found = s.replan()
        assert found.gain > 0.05 and found.moves and found.applied_at is None and found.migration_s > 0
        assert s.plan.counts == (5, 5)  # only reported
        # The planner may choose the schedule too, charged the runtime's measured overhead per step
        assert s.cluster().step_overhead_s > 0
        chosen = s.replan(schedule="auto")
        assert chosen.plan.schedule in schedules.names() and chosen.predicted_s <= found.predicted_s * (1 + 1e-9)
        with pytest.raises(PlanError, match="unknown schedule 'zb'"):
            s.replan(schedule="zb")
        # the paper's PipeDream changes what training computes: never switched to as a side effect of its method
        with pytest.raises(PlanError, match=r"method='pipedream' plans the 'pipedream' schedule .* pass schedule="):
            s.replan(method="pipedream", apply=True)
        assert s.plan.schedule == "1f1b" and s.plan.counts == (5, 5)
        assert s.replan(method="pipedream").plan.schedule == "pipedream"  # reporting it is harmless
        planner = s.auto_replan(every=3, horizon=50)
        s.run(12)
        s.wait(timeout=120)
        applied = [d for d in planner.decisions if d.applied_at is not None]
        assert applied and s.plan.counts[0] < 5
        assert s.metrics.iterations["plan_version"].iloc[-1] >= 1


def bigger_mlp() -> torch.nn.Sequential:
    """The NAS step: a new block inserted after block 1 (same widths around it), the rest unchanged."""
    blocks = list(mlp.model())
    extra = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU())
    return torch.nn.Sequential(*blocks[:2], extra, *blocks[2:])


def test_the_model_can_change_between_iterations() -> None:
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60) as s:
        s.run(3)
        s.wait(timeout=60)
        old = s.state_dict()
        # The default even split puts the new block on the already heavy stage 0: vPipe has to rebalance.
        at = s.set_model(bigger_mlp)
        assert at == 3 and s.num_layers == 11 and s.plan.counts == (6, 5)
        assert s.last_mapping == {0: 0, 1: 1, 2: None, **{j: j - 1 for j in range(3, 11)}}
        new = s.state_dict()
        for key, value in old.items():  # trained layers kept their state, one index further on after the insert
            index, name = key.split(".", 1)
            j = int(index) + (1 if int(index) >= 2 else 0)
            assert torch.equal(new[f"{j}.{name}"], value)
        s.run(3)
        s.wait(timeout=60)
        found = s.replan(apply=True)
        assert found.gain > 0.05 and found.applied_at == 6 and s.plan.counts[0] < 6
        s.run(2)
        s.wait(timeout=60)
        frame = s.metrics.iterations
        assert len(frame) == 8 and frame["loss"].notna().all() and frame["plan_version"].iloc[-1] == 2


def test_every_door_makes_one_typed_change_checked_once_without_asking_for_a_profile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The editor's message, the magics and the API become one ``Change``; the controller checks the plan it asks
    for once (the worker checks it once more), the preview and the budget check reuse the newest profile, and the
    only request for a profile is the editor's re-measure after its Apply."""
    from IPython.testing import globalipapp

    from vpipe_lab.core.change import Change
    from vpipe_lab.jupyter.partition_widget import PartitionEditor

    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", memory_budget=1 << 34, timeout=60) as s:
        s.run(2)
        s.wait(timeout=60)
        s.profile()  # a measured profile exists: what the preview and the budget check reuse
        checked: list[Plan] = []
        real_check = Plan._check
        monkeypatch.setattr(Plan, "_check", lambda plan, n: (checked.append(plan), real_check(plan, n))[1])
        asked: list[bool] = []
        real_layers = s._layers
        monkeypatch.setattr(s, "_layers", lambda reset, timeout=None: (asked.append(reset), real_layers(reset, timeout))[1])
        ed = PartitionEditor(s)
        try:
            wait_for(lambda: "current" in ed.preview)
            policies = ["keep"] * 10
            policies[3] = "swap"
            for kind in ("draft", "draft", "apply"):  # a drag, the same draft again, then Apply
                ed.receive({"kind": kind, "boundaries": [0, 3, 10], "policies": policies})
            wait_for(lambda: ed.status.get("state") == "applied", 60)
            want = Plan((0, 3, 10), policies, 4, "1f1b")
            assert s.plan == want and s.applied[-1].source == "editor" and s.applied[-1].moves == 2
            assert checked == [want]  # one check in the controller for three messages, two previews and the apply
            assert "plan v1 applied at iteration" in ed.status["message"]
            wait_for(lambda: len(asked) == 1, 30)  # the re-measure after the Apply, and nothing before it
            checked.clear()
            ip = globalipapp.start_ipython() or globalipapp.get_ipython()  # one shell, whichever test came first
            ip.run_line_magic("load_ext", "vpipe_lab")
            ip.run_line_magic("vpipe", "policy 4=recompute")
            assert s.applied[-1].source == "magic" and s.plan.policies[4].value == "recompute"
            done = s.change(Change.of(boundaries=[0, 5, 10]))
            assert done.source == "api" and done.plan == s.plan and done.version == 3 and done.moves == 2
            assert len(checked) == 2 and len(asked) == 1  # each new plan once; no profile asked for either
            # the number a door showed for its plan (the editor's what-if) is the one recorded
            shown = s.change(dataclasses.replace(Change.of(boundaries=[0, 4, 10]), predicted_s=0.25))
            assert shown.predicted_s == 0.25 and s.applied[-1].predicted_s == 0.25
            s.run(2)
            s.wait(timeout=60)
        finally:
            ed.close()


def wait_for(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cond()
