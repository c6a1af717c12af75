import pytest
import torch

from vpipe_lab.runtime.migrate import flatten, layer_state, signature, unflatten
from vpipe_lab.runtime.stage import Stage


def test_optimizer_state_survives_flattening() -> None:
    stage = Stage(torch.device("cpu"), lambda p: torch.optim.Adam(p, lr=0.1), 0)
    stage.add_layer(0, torch.nn.Linear(3, 2))
    layer = stage.layers[0]
    layer.module(torch.ones(4, 3)).sum().backward()
    layer.optimizer.step()  # type: ignore[union-attr]
    state = layer_state(layer)
    tensors: list[torch.Tensor] = []
    meta = flatten(state, tensors)
    import json

    again = unflatten(json.loads(json.dumps(meta)), tensors)
    assert set(again["optimizer"]["state"]) == {0, 1}  # integer keys come back as integers
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    fresh.load_state_dict(again["optimizer"])
    assert fresh.param_groups[0]["lr"] == 0.1
    for a, b in zip(again["module"].values(), state["module"].values()):
        assert torch.equal(a, b)


def test_unsupported_state_is_named() -> None:
    with pytest.raises(TypeError, match="type object"):
        flatten({"x": object()}, [])


def test_signature_tells_layers_apart() -> None:
    assert signature(torch.nn.Linear(3, 2)) == signature(torch.nn.Linear(3, 2))
    assert signature(torch.nn.Linear(3, 2)) != signature(torch.nn.Linear(2, 3))
