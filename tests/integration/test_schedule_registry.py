"""A schedule is one object: a toy schedule registered from a test trains in real workers equal to plain PyTorch, is
planned, simulated and offered by the magics, with no other module touched."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import vpipe_lab
from tests.runtime import reference
from vpipe_lab.core import schedules
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules import ScheduleKind, Step
from vpipe_lab.core.schedules.actions import Op
from vpipe_lab.core.workloads import cluster, workload
from vpipe_lab.examples import mlp

pytestmark = pytest.mark.slow


class LastInFirstOut(ScheduleKind):
    """GPipe whose backwards run in the reverse micro-batch order: the newest activations go first."""

    name = "gpipe-lifo"
    summary = "every forward, then the backwards newest first"
    flush = "gpipe"

    def orders(self, stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> list[list[Step]]:
        return [[(Op.F, s, m) for m in range(microbatches)]
                + [(Op.B, s, m) for m in reversed(range(microbatches))] for s in range(stages)]


@pytest.fixture
def toy() -> Iterator[ScheduleKind]:
    kind = schedules.register(LastInFirstOut())
    try:
        yield kind
    finally:
        schedules.unregister(kind.name)


def trained(session: vpipe_lab.Session) -> tuple[list[float], dict, list[int]]:  # type: ignore[type-arg]
    """The losses so far, the trained state and the last iteration's backward order on the last stage."""
    backwards = sorted((s for s in session.metrics.timeline(1) if s.kind == "backward" and s.stage == 1),
                       key=lambda s: s.start_s)
    return list(session.metrics.iterations["loss"]), session.state_dict(), [s.microbatch for s in backwards]


def assert_newest_first_and_plain(losses: list[float], state: dict, order: list[int]) -> None:  # type: ignore[type-arg]
    """The toy's order is the order that ran, and six iterations equal plain PyTorch's (losses, every tensor)."""
    assert order == [3, 2, 1, 0]
    model, expected = reference.train(mlp.model, mlp.data, mlp.loss, mlp.optimizer, iterations=6, microbatches=4)
    assert losses == pytest.approx(expected, rel=1e-5)
    reference.assert_state_matches(state, model)


def test_a_registered_schedule_trains_equal_to_plain_pytorch(toy: ScheduleKind) -> None:
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, schedule=toy.name, device="cpu", timeout=60) as session:
        assert session.plan.schedule == "gpipe-lifo"
        session.run(6)
        session.wait(timeout=120)
        result = trained(session)
    assert_newest_first_and_plain(*result)


def test_the_planners_the_simulator_and_the_magics_know_it(toy: ScheduleKind) -> None:
    from vpipe_lab import plan, simulate
    from vpipe_lab.jupyter.magics import build_parser

    profile, hw = workload("bert-48"), cluster("rtx2080ti", 4)
    found = plan(profile, hw, microbatches=8, schedule=toy.name, method="vpipe")
    assert found.schedule == toy.name
    assert vpipe_lab.estimate(found, profile, hw).inflight == (8, 8, 8, 8)  # from its order: all forwards first
    kept = Plan(found.boundaries, ("keep",) * len(found.policies), 8, toy.name)
    # its default iteration time is its order replayed with the stages' times: the simulator's replay, to rounding
    assert vpipe_lab.estimate(kept, profile, hw).iteration_s == pytest.approx(simulate(kept, profile, hw).iteration_s,
                                                                              rel=1e-9)
    auto = vpipe_lab.search(profile, hw, microbatches=8, schedule="auto")
    assert toy.name in [name for name, _ in auto.schedules]
    start = build_parser()._subparsers._group_actions[0].choices["start"]  # type: ignore[union-attr]
    assert toy.name in next(a for a in start._actions if a.dest == "schedule").choices


def test_a_schedule_registered_while_the_job_runs_reaches_its_workers_with_the_change() -> None:
    """Registered after launch: the live change that first runs it hands it to every rank (a file in the job
    directory), and training goes on equal to plain PyTorch across the switch."""
    from vpipe_lab.core.change import Change

    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60) as session:
        session.run(3)
        session.wait(timeout=120)
        kind = schedules.register(LastInFirstOut())
        try:
            done = session.change(Change.of(schedule=kind.name, source="editor"))
            assert done.plan.schedule == kind.name and session.plan.schedule == kind.name
            session.run(3)
            session.wait(timeout=120)
            result = trained(session)
        finally:
            schedules.unregister(kind.name)
    assert_newest_first_and_plain(*result)


def test_workers_that_do_not_know_a_schedule_refuse_the_change_and_train_on() -> None:
    """As an attached job's workers would (they learn schedules from their own script): the change is refused on
    every rank alike, said once, nothing moves, and training goes on."""
    from vpipe_lab.core.change import Change
    from vpipe_lab.core.errors import PlanError

    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60) as session:
        session.run(2)
        session.wait(timeout=120)
        kind = schedules.register(LastInFirstOut())
        try:
            session._live._known.add(kind.name)  # the controller believes the workers know it; they do not
            with pytest.raises(PlanError, match=r"unknown schedule 'gpipe-lifo'.*registered in their own script"):
                session.change(Change.of(schedule=kind.name))
        finally:
            schedules.unregister(kind.name)
        assert session.plan.schedule == "1f1b" and session.status == "idle" and session.applied == []
        session.run(2)
        assert session.wait(timeout=120) == 4
