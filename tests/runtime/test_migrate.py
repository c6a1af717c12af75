import json

import pytest
import torch

from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.migrate import flatten, layer_state, materialise, signature, unflatten


def test_layer_state_survives_flattening_and_fills_another_stage() -> None:
    """A layer's tensors and per-parameter optimizer state cross as JSON + tensors and continue bit for bit."""
    stage = Stage(torch.device("cpu"), lambda p: torch.optim.Adam(p, lr=0.1), 0)
    stage.add_layer(0, torch.nn.Linear(3, 2))
    layer = stage.layers[0]
    layer.module(torch.ones(4, 3)).sum().backward()
    stage.step()
    stage.optimizer.param_groups[0]["lr"] = 0.05  # type: ignore[union-attr]  # as a scheduler would
    state = layer_state(stage, 0)
    tensors: list[torch.Tensor] = []
    meta = flatten(state, tensors)
    again = unflatten(json.loads(json.dumps(meta)), tensors)
    assert set(again["tensors"]) == {"0.weight", "0.bias"}
    assert set(again["optimizer"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    other = Stage(torch.device("cpu"), lambda p: torch.optim.Adam(p, lr=0.1), 0)
    shell = torch.nn.Linear(3, 2, device="meta")
    materialise(shell, stage.layers[0].tensors, again["tensors"], torch.device("cpu"))
    other.add_layer(0, shell, stage.layers[0].tensors, again["groups"], again["optimizer"])
    assert other.optimizer.param_groups[0]["lr"] == 0.05  # type: ignore[union-attr]  # the group's options came too
    for s in (stage, other):
        s.layers[0].module(torch.ones(4, 3)).sum().backward()
        s.step()
    for name in ("0.weight", "0.bias"):
        assert torch.equal(stage.tensors[name], other.tensors[name])


def test_unsupported_state_is_named() -> None:
    with pytest.raises(TypeError, match="type object"):
        flatten({"x": object()}, [])


def test_signature_tells_layers_apart() -> None:
    assert signature(torch.nn.Linear(3, 2)) == signature(torch.nn.Linear(3, 2))
    assert signature(torch.nn.Linear(3, 2)) != signature(torch.nn.Linear(2, 3))
