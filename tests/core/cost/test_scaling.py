"""A profile at another micro-batch size: measured points interpolated, memory in proportion."""

from __future__ import annotations

import pytest

from vpipe_lab.core.cost import scaling
from vpipe_lab.core.errors import ProfileError
from vpipe_lab.core.profile import LayerCost, ModelProfile


def layer(times: tuple[tuple[int, float, float], ...] = ()) -> LayerCost:
    # 4 samples take 4 ms forward, 8 ms backward; measured: 2 samples 3 ms/6 ms, 8 samples 6 ms/12 ms
    return LayerCost("l", 4e-3, 8e-3, 400, 100, 40, 1000, 2000, times)


def test_interpolates_between_measured_sizes_and_scales_memory() -> None:
    profile = ModelProfile((layer(((2, 3e-3, 6e-3), (8, 6e-3, 12e-3))),), "m", microbatch_size=4)
    at6 = scaling.at(profile, 6).layers[0]
    assert at6.forward_s == pytest.approx(5e-3) and at6.backward_s == pytest.approx(10e-3)
    assert (at6.activation_bytes, at6.input_bytes, at6.output_bytes) == (600, 150, 60)
    assert (at6.param_bytes, at6.optimizer_bytes) == (1000, 2000)
    assert scaling.at(profile, 4) is profile
    # outside the measured sizes: the nearest measured per-sample time, no invented gain
    assert scaling.at(profile, 16).layers[0].forward_s == pytest.approx(12e-3)
    # below: the line through the two smallest points (2 -> 3 ms, 4 -> 4 ms) keeps the fixed cost: 2.5 ms at 1
    assert scaling.at(profile, 1).layers[0].forward_s == pytest.approx(2.5e-3)


def test_without_points_time_is_linear() -> None:
    profile = ModelProfile((layer(),), "m", microbatch_size=4)
    assert scaling.at(profile, 8).layers[0].forward_s == pytest.approx(8e-3)
    assert scaling.throughput_curve(profile, [2, 4, 8]) == [(b, pytest.approx(4 / 12e-3)) for b in (2, 4, 8)]


def test_curve_rises_with_measured_efficiency() -> None:
    profile = ModelProfile((layer(((2, 3e-3, 6e-3), (8, 6e-3, 12e-3))),), "m", microbatch_size=4)
    curve = scaling.throughput_curve(profile, scaling.measured_sizes(profile))
    assert [b for b, _ in curve] == [2, 4, 8]
    assert curve[0][1] < curve[1][1] < curve[2][1]


def test_a_profile_without_its_size_cannot_be_rescaled() -> None:
    with pytest.raises(ProfileError, match="microbatch_size"):
        scaling.at(ModelProfile((layer(),), "m"), 8)
    with pytest.raises(ProfileError, match="whole number"):
        scaling.at(ModelProfile((layer(),), "m", microbatch_size=4), 0)


def test_times_round_trip_through_json() -> None:
    profile = ModelProfile((layer(((8, 6e-3, 12e-3), (2, 3e-3, 6e-3))),), "m", microbatch_size=4)
    again = ModelProfile.from_json(profile.to_json())
    assert again == profile and again.layers[0].times[0][0] == 2  # sorted by size
    with pytest.raises(ProfileError, match="times"):
        LayerCost.from_dict({**layer().to_dict(), "times": [[2, 1.0]]})
