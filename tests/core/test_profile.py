import json

import pytest

from vpipe_lab.core.errors import ProfileError
from vpipe_lab.core.profile import Cluster, LayerCost, ModelProfile, SharedTensor


def layer(i: int = 0, **kw: object) -> LayerCost:
    base = dict(name=f"l{i}", forward_s=1.0, backward_s=2.0, activation_bytes=100, input_bytes=10,
                output_bytes=10, param_bytes=50, optimizer_bytes=100)
    base.update(kw)
    return LayerCost(**base)  # type: ignore[arg-type]


def test_profile_json_round_trip() -> None:
    profile = ModelProfile((layer(0), layer(1, forward_s=0.5)), name="tiny")
    again = ModelProfile.from_json(profile.to_json())
    assert again == profile
    assert again.names == ("l0", "l1")


def test_profile_errors_name_the_field() -> None:
    doc = json.loads(ModelProfile((layer(),)).to_json())
    doc["layers"][0]["forward_s"] = "fast"
    with pytest.raises(ProfileError, match=r"layers\[0\]\.forward_s must be a number"):
        ModelProfile.from_dict(doc)
    del doc["layers"][0]["forward_s"]
    with pytest.raises(ProfileError, match=r"layers\[0\]\.forward_s is missing"):
        ModelProfile.from_dict(doc)
    doc = json.loads(ModelProfile((layer(),)).to_json())
    doc["layers"][0]["param_bytes"] = 1.5
    with pytest.raises(ProfileError, match="whole number"):
        ModelProfile.from_dict(doc)
    with pytest.raises(ProfileError, match="version"):
        ModelProfile.from_dict({**doc, "version": 99})
    with pytest.raises(ProfileError, match="not valid JSON"):
        ModelProfile.from_json("{not json")
    with pytest.raises(ProfileError, match="empty"):
        ModelProfile(())
    with pytest.raises(ProfileError, match="forward_s must be finite and >= 0"):
        layer(forward_s=-1.0)


def test_cluster_budgets_and_json() -> None:
    c = Cluster(3, 1000, 1e9, 1e9)
    assert c.budgets == (1000, 1000, 1000)
    per = Cluster(2, (10, 20), 1e9, 1e9, shared_link=True, swap_overlaps=False)
    assert per.budgets == (10, 20)
    assert Cluster.from_json(per.to_json()) == per and not Cluster.from_json(per.to_json()).swap_overlaps
    assert Cluster.from_dict({k: v for k, v in c.to_dict().items() if k != "swap_overlaps"}).swap_overlaps
    with pytest.raises(ProfileError, match="2 entries for 3 stages"):
        Cluster(3, (1, 2), 1e9, 1e9)
    with pytest.raises(ProfileError, match="swap_bandwidth"):
        Cluster(2, 10, 0.0, 1e9)


def test_a_measured_weight_step_round_trips_and_must_fit_its_backward() -> None:
    layer = LayerCost("l", 1.0, 2.0, 10, 1, 1, param_bytes=4, weight_grad_s=0.75)
    assert LayerCost.from_dict(layer.to_dict()) == layer and layer.wgrad_s == 0.75
    assert LayerCost("l", 1.0, 2.0, 10, 1, 1, param_bytes=4).wgrad_s == 1.0  # not measured: half the backward
    assert LayerCost("l", 1.0, 2.0, 10, 1, 1, param_bytes=0).wgrad_s == 0.0  # no weights, no weight step
    with pytest.raises(ProfileError, match="weight_grad_s is part of backward_s"):
        LayerCost("l", 1.0, 2.0, 10, 1, 1, 4, weight_grad_s=3.0)
    cluster = Cluster(2, 10**9, 1e9, 1e9, step_overhead_s=1e-4)
    assert Cluster.from_dict(cluster.to_dict()) == cluster


def test_a_shared_tensor_round_trips_and_names_units_the_profile_has() -> None:
    tie = SharedTensor("shared.weight", (2, 0), param_bytes=40, optimizer_bytes=80)
    profile = ModelProfile((layer(0), layer(1), layer(2)), shared=(tie,))
    again = ModelProfile.from_json(profile.to_json())
    assert again == profile and again.shared[0].units == (0, 2)
    assert "shared" not in ModelProfile((layer(),)).to_dict()  # a profile without ties reads as before
    with pytest.raises(ProfileError, match=r"names unit 2 but the profile has 2 layers"):
        ModelProfile((layer(0), layer(1)), shared=(tie,))
    with pytest.raises(ProfileError, match="two or more unit indices"):
        SharedTensor("w", (1, 1), param_bytes=4)
    doc = profile.to_dict()
    doc["shared"][0]["units"] = "0,2"
    with pytest.raises(ProfileError, match=r"shared\[0\]\.units must be a list of whole numbers"):
        ModelProfile.from_dict(doc)
    doc["shared"] = {"w": 1}
    with pytest.raises(ProfileError, match=r"profile\.shared must be a list of SharedTensor objects"):
        ModelProfile.from_dict(doc)
