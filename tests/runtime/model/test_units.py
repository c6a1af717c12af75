"""Reaching into a unit's tensors by name, and the per-layer seeds."""

from __future__ import annotations

import pytest
import torch

from vpipe_lab.runtime.model.units import get_tensor, layer_seed, set_tensor, tensors_of


def test_set_tensor_binds_the_very_object_and_names_a_missing_one() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    set_tensor(model, "0.weight", weight)
    assert get_tensor(model, "0.weight") is weight and model[0].weight is weight
    stats = torch.ones(2)
    set_tensor(model, "1.running_mean", stats)
    assert model[1].running_mean is stats
    with pytest.raises(KeyError, match=r"0\.nothing"):
        get_tensor(model, "0.nothing")
    with pytest.raises(KeyError, match=r"1\.bogus"):
        set_tensor(model, "1.bogus", stats)


def test_tensors_of_any_structure_in_order() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    assert tensors_of(a) == (a,)
    got = tensors_of({"x": a, "mask": None, "pair": (b, 3)})
    assert len(got) == 2 and {id(t) for t in got} == {id(a), id(b)}


def test_layer_seed_is_deterministic_and_bounded() -> None:
    assert layer_seed(1, 2, 3, 4) == layer_seed(1, 2, 3, 4)
    assert 0 <= layer_seed(10**9, 10**6, 64, 1000) < 2**62


def test_layer_stats_keep_samples_and_report_their_median() -> None:
    from vpipe_lab.runtime.model.units import LayerStats

    st = LayerStats()
    for seconds in (1.0, 2.0, 100.0):  # one slow outlier
        st.add_forward(seconds)
    st.add_forward(0.5, extend=True)  # the loss belongs to the latest forward
    assert st.forward_times == [1.0, 2.0, 100.5] and st.typical(st.forward_times) == 2.0
    st.add_backward(3.0)
    st.add_backward(5.0)
    assert st.backwards == 2 and st.typical(st.backward_times) == 4.0 and LayerStats.typical([]) == 0.0
