"""A unit's state as it moves or is saved: its values, its optimizer state and its groups' options, loaded back equal."""

from __future__ import annotations

import torch

from vpipe_lab.runtime.engine.stage import Stage


def stage(seed: int) -> Stage:
    torch.manual_seed(seed)
    s = Stage(torch.device("cpu"), lambda p: torch.optim.Adam(p, lr=0.01), seed=0)
    for i in range(2):
        s.add_layer(i, torch.nn.Linear(4, 4))
    return s


def trained() -> Stage:
    s = stage(0)
    for segment in s.segments():
        out = s.forward(0, segment, torch.randn(3, 4))
        s.backward(0, segment, (torch.ones_like(out),))
    s.step()
    return s


def test_a_units_state_loads_into_another_stage_equal() -> None:
    source, target = trained(), stage(1)
    state = source.unit_state(1)
    assert set(state) == {"tensors", "optimizer", "groups", "policy"} and state["policy"] == "keep"
    assert set(state["tensors"]) == {"1.weight", "1.bias"} and state["optimizer"]["1.weight"]["step"] == 1
    target.load_values(state["tensors"])
    target.load_optimizer(state["optimizer"], state["groups"])
    moved = target.unit_state(1)
    assert all(torch.equal(moved["tensors"][k], v) for k, v in state["tensors"].items())
    assert all(torch.equal(moved["optimizer"]["1.weight"][k], v) for k, v in state["optimizer"]["1.weight"].items()
               if isinstance(v, torch.Tensor))
    assert not torch.equal(target.unit_state(0)["tensors"]["0.weight"], source.unit_state(0)["tensors"]["0.weight"])
