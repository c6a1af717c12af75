"""The one serialiser: every value type's document is its fields, read back checked, with the path to what is wrong."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from vpipe_lab.core import documents
from vpipe_lab.core.documents import sparse
from vpipe_lab.core.errors import ProfileError
from vpipe_lab.core.interop.bundle import MoeInfo, StageSpec, UnitInfo
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.policy import Policy
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile, SharedTensor
from vpipe_lab.core.sharding import Sharding
from vpipe_lab.core.timeline import Span, Timeline


@dataclass(frozen=True)
class Inner:
    size: int
    ratio: float = 1.0


@dataclass(frozen=True)
class Outer:
    name: str
    inners: tuple[Inner, ...]
    policy: Policy = Policy.KEEP
    pair: tuple[int, str] = (0, "")
    table: dict[str, int] = field(default_factory=dict)
    note: str | None = sparse(None)
    derived: int = field(default=0, init=False)


def test_a_nested_value_round_trips_through_json_and_a_sparse_default_is_left_out() -> None:
    value = Outer("a", (Inner(2), Inner(3, 0.5)), Policy.SWAP, (4, "x"), {"k": 1})
    doc = documents.dump(value)
    assert doc == {"name": "a", "inners": [{"size": 2, "ratio": 1.0}, {"size": 3, "ratio": 0.5}], "policy": "swap",
                   "pair": [4, "x"], "table": {"k": 1}}  # no note (its default), no derived (not a constructor field)
    assert documents.load(Outer, json.loads(json.dumps(doc)), "outer", ProfileError) == value
    assert documents.dump(Outer("b", (), note="n"))["note"] == "n"


@pytest.mark.parametrize(("change", "said"), [
    ({"inners": [{"size": "2"}]}, "outer.inners[0].size must be a whole number, got '2'"),
    ({"inners": [{"size": True}]}, "outer.inners[0].size must be a whole number, got True"),
    ({"inners": [{"ratio": 1.0}]}, "outer.inners[0].size is missing (a whole number)"),
    ({"inners": "x"}, "outer.inners must be a list of Inner objects, got 'x'"),
    ({"policy": "fly"}, "outer.policy must be one of 'keep', 'swap', 'recompute', got 'fly'"),
    ({"pair": [1]}, "outer.pair must have 2 items"),
    ({"table": {"k": 1.5}}, "outer.table['k'] must be a whole number, got 1.5"),
    ({"colour": "red"}, "outer has unknown field(s) ['colour'] for a Outer"),
    ({"note": 3}, "outer.note must be a string, got 3"),
])
def test_a_wrong_field_is_named_by_its_path_in_the_caller_s_error(change: dict[str, object], said: str) -> None:
    doc = {"name": "a", "inners": [{"size": 2}], **change}
    with pytest.raises(ProfileError) as caught:
        documents.load_fields(Outer, doc, "outer", ProfileError)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_whole_floats_are_counts_ints_are_floats_and_extra_keys_are_passed_over_when_asked() -> None:
    got = documents.load_fields(Inner, {"size": 1e3, "ratio": 2, "later": "x"}, "inner", ProfileError, extra="ignore")
    assert got == Inner(1000, 2.0) and isinstance(got.size, int) and isinstance(got.ratio, float)
    with pytest.raises(ProfileError, match=r"inner\.size must be a whole number, got 2\.5"):
        documents.load_fields(Inner, {"size": 2.5}, "inner", ProfileError)


def test_the_type_s_own_rules_are_said_where_the_document_broke_them() -> None:
    doc = documents.dump(LayerCost("h", 0.1, 0.2, 1, 1, 1, 1))
    with pytest.raises(ProfileError, match=r"layers\[3\]: layer 'h'\.backward_s must be finite and >= 0"):
        LayerCost.from_dict({**doc, "backward_s": -1}, "layers[3]")
    with pytest.raises(ProfileError, match=r"^plan: "):
        Plan.from_dict({"kind": "plan", "boundaries": [0, 1], "policies": ["keep"], "microbatches": 0})


def test_adding_a_field_is_one_edit_its_line_in_the_class() -> None:
    @dataclass(frozen=True)
    class Grown(Inner):
        colour: str = sparse("")

    grown = Grown(2, 1.0, "red")
    assert documents.load(Grown, documents.dump(grown), "grown", ProfileError) == grown
    assert "colour" not in documents.dump(Grown(2))


def test_every_value_type_reads_back_what_it_writes() -> None:
    """The documents the lab writes (files, the wire) go through the one serialiser and come back equal."""
    cost = LayerCost("h.0", 0.1, 0.2, 64, 8, 8, 32, 16, ((2, 0.05, 0.1),), 0.07, 5, 6)
    profile = ModelProfile((cost, LayerCost("h.1", 0.1, 0.2, 1, 1, 1, 1)), "m", 4, "measured",
                           (SharedTensor("w", (0, 1), 32),))
    cluster = Cluster(2, (100, 200), 1e9, 2e9, shared_link=True, shard_bandwidth=3.0)
    plan = Plan((0, 1, 2), (Policy.KEEP, Policy.RECOMPUTE), 4, "1f1b", shards=2, sharding=(Sharding.HOLD,
                                                                                              Sharding.STREAM))
    unit = UnitInfo("u", ("a", "b"), "block:X", ("t",), (MoeInfo("a.moe", 8, 2, None),), ("a.eager",))
    stage = StageSpec(1, 1, "b", ("b",), ("b",), (), (1,), ())
    assert LayerCost.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
    assert ModelProfile.from_json(profile.to_json()) == profile
    assert Cluster.from_json(cluster.to_json()) == cluster
    assert Plan.from_json(plan.to_json()) == plan and plan.to_dict()["stages"] == 2
    assert UnitInfo.from_dict(unit.to_dict()) == unit and StageSpec.from_dict(stage.to_dict(), "s") == stage
    timeline = Timeline((Span(0, "forward", 1, None, 0.0, 1.0), Span(1, "backward", 0, 2, 1.0, 2.5, 3, 1, 1)))
    assert Timeline.from_json(timeline.to_json()) == timeline
    assert "virtual_stages" not in plan.to_dict() and "times" not in LayerCost("x", 0, 0, 0, 0, 0, 0).to_dict()
