from __future__ import annotations

from vpipe_lab.control.changes.profiles import Profiles
from vpipe_lab.core.profile import LayerCost, SharedTensor
from vpipe_lab.wire.events import LayerMeasure


def doc(index: int, name: str, forward: float, samples: int, params: int = 10, weight: float | None = None,
        deferrable: float = 1.0) -> LayerMeasure:
    cost = LayerCost(name, forward, 2 * forward, 100, 10, 10, params, weight_grad_s=weight)
    return LayerMeasure.from_dict(LayerMeasure(index, cost, samples, deferrable).to_dict())  # as it comes off the wire


def test_a_layer_without_samples_keeps_its_last_measurement() -> None:
    profiles = Profiles()
    first = profiles.merge([doc(1, "b", 0.2, 3), doc(0, "a", 0.1, 3)], microbatch_size=4)
    assert [x.name for x in first.layers] == ["a", "b"] and first.microbatch_size == 4
    moved = profiles.merge([doc(0, "a", 0.0, 0, params=20), doc(1, "b", 0.3, 2)], microbatch_size=4)
    assert moved.layers[0].forward_s == 0.1 and moved.layers[0].param_bytes == 20  # time kept, size current
    assert moved.layers[1].forward_s == 0.3
    profiles.forget()
    assert profiles.merge([doc(0, "a", 0.0, 0)], 4).layers[0].forward_s == 0.0


def test_the_newest_profile_is_kept_for_previews_until_the_model_changes() -> None:
    profiles = Profiles()
    assert profiles.newest is None
    merged = profiles.merge([doc(0, "a", 0.1, 3)], 4)
    assert profiles.newest is merged
    profiles.forget()  # set_model: its layers are other layers
    assert profiles.newest is None


def test_a_weight_step_is_measured_kept_across_unsplit_schedules_or_estimated() -> None:
    """Never split: half the backward times the deferrable share. Split once: the measurement, which stands when a
    later schedule runs the backward whole again."""
    profiles = Profiles()
    unsplit = doc(0, "a", 0.1, 3, deferrable=0.5)
    assert profiles.merge([unsplit], 4).layers[0].weight_grad_s == 0.2 / 2 * 0.5
    split = doc(0, "a", 0.1, 3, weight=0.07)
    assert profiles.merge([split], 4).layers[0].weight_grad_s == 0.07
    assert profiles.merge([unsplit], 4).layers[0].weight_grad_s == 0.07


def test_a_tensor_two_layers_report_using_becomes_one_shared_tensor() -> None:
    """Each stage reports the tied parameters of its own layers; the merge names every unit that uses one. A name only
    one layer reports (its other user not measured yet) is no tie; optimizer state taken from whoever has it."""
    cost = LayerCost("x", 0.1, 0.2, 100, 10, 10, 50)
    measures = [LayerMeasure.from_dict(LayerMeasure(i, cost, 3, shared=tied).to_dict()) for i, tied in (
        (0, {"emb": [40, 0]}), (1, {}), (2, {"emb": [40, 80], "lone": [8, 16]}))]
    profile = Profiles().merge(measures, 4)
    assert profile.shared == (SharedTensor("emb", (0, 2), 40, 80),)
