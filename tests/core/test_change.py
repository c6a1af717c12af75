"""A live change is one typed value whichever door made it; a plan is checked once per number of layers."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from vpipe_lab.core import schedules
from vpipe_lab.core.change import Applied, Change
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Plan, Policy
from vpipe_lab.core.schedules.gpipe import GPipe

CURRENT = Plan.from_counts([3, 5], 4)


def test_the_editor_the_magics_and_the_api_make_the_same_change() -> None:
    editor = Change.of(boundaries=[0, 3, 8], policies=["keep"] * 3 + ["swap"] + ["keep"] * 4, source="editor")
    magic = Change.of(boundaries=(0, 3, 8), policies={3: "s"}, source="magic")
    assert editor.on(CURRENT) == magic.on(CURRENT) == CURRENT.with_policies({3: Policy.SWAP})
    assert magic.policies == ((3, Policy.SWAP),) and magic.source == "magic"
    assert Change.of(policies={3: "swap"}) == magic.__class__(None, ((3, Policy.SWAP),))  # source is not compared


def test_on_keeps_what_it_does_not_name_and_to_replaces_everything() -> None:
    change = Change.of(microbatches=8, schedule="gpipe")
    plan = change.on(CURRENT)
    assert (plan.boundaries, plan.policies, plan.microbatches, plan.schedule) == (
        CURRENT.boundaries, CURRENT.policies, 8, "gpipe")
    other = Plan((0, 2, 4, 6, 8), (Policy.RECOMPUTE,) * 8, 4, "interleaved-1f1b", 2)
    assert Change.to(other).on(CURRENT) == other
    assert Change().empty and not change.empty and Change().on(CURRENT) == CURRENT


def test_resolve_checks_against_the_job_and_names_what_is_wrong() -> None:
    assert Change.of(boundaries=[0, 4, 8]).resolve(CURRENT, 8, 2).boundaries == (0, 4, 8)
    with pytest.raises(PlanError, match="no layers"):
        Change.of(boundaries=[0, 8, 8]).resolve(CURRENT, 8, 2)
    with pytest.raises(PlanError, match="3 stages but the pipeline has 2"):
        Change.of(boundaries=[0, 2, 5, 8]).resolve(CURRENT, 8, 2)
    with pytest.raises(PlanError, match="layer 9 does not exist"):
        Change.of(policies={9: "swap"}).on(CURRENT)


@pytest.mark.parametrize("kwargs, match", [
    ({"policies": {1: "sideways"}}, "unknown policy 'sideways'"),
    ({"policies": {-1: "swap"}}, "layer -1"),
    ({"policies": "swap"}, "not a string"),
    ({"boundaries": [0, 2.5, 8]}, "whole numbers"),
    ({"microbatches": 0}, "microbatches must be a whole number >= 1"),
    ({"virtual_stages": True}, "virtual_stages"),
    ({"schedule": 3}, "schedule's name"),
    ({"source": "someone"}, "source is one of"),
])
def test_a_bad_change_is_refused_where_it_is_made(kwargs: dict, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Change.of(**kwargs)


def test_describe_says_what_changes() -> None:
    assert Change().describe() == "no change"
    assert Change.of(boundaries=[0, 3, 8], policies={3: "r"}, microbatches=8).describe() == (
        "boundaries [0, 3, 8]; layer 3 recompute; M=8")
    done = Applied(CURRENT, 3, 40, moves=2, moved_bytes=10, pause_s=0.1)
    assert done.describe() == "plan v3 applied at iteration 40 (2 layer(s) moved)"


def test_a_plan_is_checked_once_per_number_of_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = Plan._check
    monkeypatch.setattr(Plan, "_check", lambda self, n: (calls.append(n), real(self, n))[1])
    plan = Plan.from_counts([4, 4], 4, schedule="gpipe", policy="swap")
    for _ in range(5):  # the cost model, the simulator, the preview and the live path all ask, of equal plans
        Change.to(plan).on(CURRENT).validate(8, 2)
    plan.validate()
    assert calls == [8] and plan.checked(8) and plan.checked()
    with pytest.raises(PlanError, match="pipeline has 3"):  # the stage count is still asked every time
        plan.validate(8, 3)
    with pytest.raises(PlanError, match="policies for 9 layers"):
        plan.validate(9)
    assert calls == [8, 9] and plan.checked(8) and not plan.checked(9)


def test_a_check_does_not_travel_or_outlive_its_schedule() -> None:
    plan = Plan.from_counts([4, 4], 4).validate(8, 2)
    assert pickle.loads(pickle.dumps(plan)) == plan and "_checked" not in vars(plan)  # nothing travels with it
    toy = Plan.from_counts([4, 4], 4, schedule="toy-change")
    with pytest.raises(PlanError, match="unknown schedule"):
        toy.validate()

    class Toy(GPipe):
        name = "toy-change"

    try:
        schedules.register(Toy())
        assert toy.validate(8, 2).checked()
        schedules.unregister("toy-change")
        assert not toy.checked()  # the schedule it was checked with is gone
        with pytest.raises(PlanError, match="unknown schedule"):
            toy.validate(8, 2)
    finally:
        schedules.unregister("toy-change")


def test_a_new_schedule_keeps_what_it_can_and_cuts_evenly_what_it_cannot() -> None:
    assert Change.of(schedule="gpipe").on(CURRENT).boundaries == CURRENT.boundaries  # same chunks, same places
    looped = Change.of(schedule="interleaved-1f1b").on(CURRENT)
    assert (looped.virtual_stages, looped.boundaries, looped.placement) == (2, (0, 2, 4, 6, 8), (0, 1, 0, 1))
    vee = Change.of(schedule="zbv").on(looped)  # two chunks per stage still, but in a V: cut again
    assert (vee.virtual_stages, vee.boundaries, vee.placement) == (2, (0, 2, 4, 6, 8), (0, 1, 1, 0))
    moved = Change.of(boundaries=[0, 1, 4, 7, 8], schedule="interleaved-1f1b").on(vee)
    assert moved.boundaries == (0, 1, 4, 7, 8) and moved.virtual_stages == 2  # boundaries given are taken
    back = Change.of(schedule="1f1b").on(looped)
    assert (back.virtual_stages, back.boundaries) == (1, (0, 4, 8))
    four = Change.of(schedule="interleaved-1f1b", virtual_stages=4).on(CURRENT)
    assert four.chunks == 8 and four.validate(8, 2).placement == tuple(c % 2 for c in range(8))


def test_a_change_keeps_the_jobs_mesh_and_refuses_another() -> None:
    """The running job's mesh is its processes: a plan for another is refused with the way to get there; a plan that
    names no mesh runs on the job's; each stage's sharding is a change like a policy."""
    from vpipe_lab.core.sharding import Sharding

    current = Plan((0, 2, 4), ("keep",) * 4, 2, shards=2)
    moved = Change.of(boundaries=(0, 1, 4)).resolve(current, 4, 2)
    assert (moved.shards, moved.replicas) == (2, 1)
    plain = Change.to(Plan((0, 3, 4), ("keep",) * 4, 2)).resolve(current, 4, 2)
    assert plain.shards == 2 and plain.boundaries == (0, 3, 4)
    with pytest.raises(PlanError, match=r"the job runs 2 x 1: its processes are its mesh.*resume=path"):
        Change.to(Plan((0, 3, 4), ("keep",) * 4, 2, shards=4)).resolve(current, 4, 2)
    streamed = Change.of(sharding=("stream", "hold")).resolve(current, 4, 2)
    assert streamed.sharding == (Sharding.STREAM, Sharding.HOLD)
    assert Change.of(sharding=("stream", "hold")).describe() == "sharding stream/hold"
    with pytest.raises(PlanError, match="this job runs shards=1"):
        Change.of(sharding=("stream", "hold")).resolve(Plan((0, 2, 4), ("keep",) * 4, 2), 4, 2)
    with pytest.raises(PlanError, match="one entry per stage, not a string"):
        Change.of(sharding="stream")


def test_a_change_carries_the_prediction_its_door_showed_and_refuses_a_meaningless_one() -> None:
    shown = Change.of(boundaries=(0, 3, 8), source="editor")
    told = dataclasses.replace(shown, predicted_s=0.158)
    assert told.predicted_s == 0.158 and told == shown  # the number shown is not part of what is asked
    for bad in (0, -1.0, float("inf"), float("nan"), "fast"):
        with pytest.raises(PlanError, match="predicted_s must be a positive number of seconds"):
            dataclasses.replace(shown, predicted_s=bad)
