"""Plans: parsing, JSON, helpers and the errors validation gives."""

import pytest

from vpipe_lab.core import schedules
from vpipe_lab.core.errors import PlanError, ProfileError
from vpipe_lab.core.plan import Estimate, Plan, Policy, Sharding


def test_plan_round_trip_and_helpers() -> None:
    plan = Plan((0, 2, 5), ("keep", "swap", "recompute", "keep", "keep"), 4, "gpipe")
    assert plan.stages == 2 and plan.counts == (2, 3)
    assert plan.stage_of(4) == 1 and list(plan.layers_of(0)) == [0, 1]
    assert Plan.from_json(plan.to_json()) == plan
    changed = plan.with_policies({0: "r"})
    assert changed.policies[0] is Policy.RECOMPUTE and plan.policies[0] is Policy.KEEP
    assert Plan.from_counts([2, 3], 4, "gpipe").boundaries == (0, 2, 5)
    assert "[0:2]KS" in plan.describe()


@pytest.mark.parametrize(
    ("boundaries", "policies", "m", "match"),
    [
        ((0, 3, 3), "kkk", 2, "stage 1 no layers"),
        ((1, 3), "kkk", 2, "must start at 0"),
        ((0, 2), "kkk", 2, "end at the number of layers"),
        ((0, 3), "kk", 2, "2 policies for 3 layers"),
        ((0, 3), "kkk", 0, "microbatches must be"),
        ((0,), "kkk", 2, "stages \\+ 1 >= 2"),
    ],
)
def test_plan_validate_names_the_problem(boundaries: tuple[int, ...], policies: str, m: int, match: str) -> None:
    plan = Plan(boundaries, tuple(policies), m)
    with pytest.raises(PlanError, match=match):
        plan.validate(3)


def test_plan_validate_checks_stages_and_schedule() -> None:
    with pytest.raises(PlanError, match="pipeline has 3"):
        Plan((0, 1, 2), "kk", 1).validate(2, stages=3)
    with pytest.raises(PlanError, match="unknown schedule"):
        Plan((0, 2), "kk", 1, "zigzag").validate()
    with pytest.raises(PlanError, match="layer 7 does not exist"):
        Plan((0, 2), "kk", 1).with_policies({7: "swap"})


def test_every_schedule_name_validates_and_estimates_round_trip() -> None:
    for name in schedules.names():
        kind = schedules.get(name)
        virtual = kind.virtual_choices[0] if kind.virtual_choices else 1  # ZBV and DualPipeV: two chunks per stage
        assert Plan((0, 1, 2), "kk", 2, name, virtual).validate(2).schedule == name
    est = Estimate(1.0, (0.4, 0.5), (10, 30), (20, 20), 0.2, False)
    assert est.bottleneck == 1 and est.over_budget == (0, 10) and est.to_dict()["peak_bytes"] == [10, 30]


def test_a_plan_carries_its_mesh_and_each_stages_sharding_through_json_and_changes() -> None:
    """plan.json says stages, shards and replicas when the plan is not one of whole devices; a partition or policy
    edit keeps the mesh, a new stage count starts each stage's sharding over."""
    plan = Plan((0, 2, 4), ("keep",) * 4, 4, shards=2, replicas=3, sharding=("stream", "hold"))
    assert plan.devices == 12 and plan.data_parallel == 6 and plan.sharding_of(0) is Sharding.STREAM
    doc = plan.to_dict()
    assert (doc["stages"], doc["shards"], doc["replicas"], doc["sharding"]) == (2, 2, 3, ["stream", "hold"])
    assert Plan.from_json(plan.to_json()) == plan
    whole = Plan((0, 2, 4), ("keep",) * 4, 4).to_dict()  # a pipeline of whole devices says so too
    assert {k: whole.get(k) for k in ("stages", "shards", "replicas", "sharding")} == {
        "stages": 2, "shards": 1, "replicas": 1, "sharding": None}
    moved = plan.with_boundaries((0, 1, 4)).with_policies({0: "recompute"}).replace(microbatches=8)
    assert (moved.shards, moved.replicas, moved.sharding) == (2, 3, plan.sharding)
    assert plan.with_boundaries((0, 1, 2, 4)).sharding == ()
    assert plan.with_mesh(shards=1).sharding == () and plan.with_mesh(shards=1).shards == 1
    assert plan.describe().startswith("1f1b 2x2x3 stream/hold M=4")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"shards": 0}, "shards"),
    ({"replicas": 0}, "replicas"),
    ({"sharding": ("hold", "hold")}, "for sharded stages, and this plan has shards=1"),
    ({"shards": 2, "sharding": ("hold",)}, "1 sharding entries for 2 stages"),
    ({"shards": 2, "schedule": "pipedream"}, "shards=2 reduce each stage's gradients over its shards once per step"),
])
def test_a_mesh_that_cannot_be_is_refused_naming_the_fix(kwargs: dict[str, object], match: str) -> None:
    args = {"schedule": "1f1b", **kwargs}
    with pytest.raises(PlanError, match=match):
        Plan((0, 2, 4), ("keep",) * 4, 4, **args).validate()  # type: ignore[arg-type]


def test_a_plan_json_with_a_wrong_mesh_is_refused_by_field() -> None:
    doc = Plan((0, 2, 4), ("keep",) * 4, 4, shards=2).to_dict()
    for key, value, match in (("shards", "2", "plan.shards must be a whole number"),
                              ("stages", 3, "stages is 3 but its boundaries give 2"),
                              ("sharding", "hold", "plan.sharding must be a list")):
        with pytest.raises(ProfileError, match=match):
            Plan.from_dict({**doc, key: value})
