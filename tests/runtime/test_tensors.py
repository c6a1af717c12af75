import torch

from vpipe_lab.runtime.stage import Stage
from vpipe_lab.runtime.tensors import pack_state, tensor_to_wire
from vpipe_lab.wire.tensorwire import rebuild


def test_wire_round_trip_of_dtypes() -> None:
    for t in (torch.randn(3, 2), torch.arange(5), torch.tensor([True, False]), torch.randn(2).to(torch.bfloat16),
              torch.tensor(3.5)):
        meta, raw = tensor_to_wire("k", t)
        back = rebuild([meta], [raw])["k"]
        assert back.dtype == t.dtype and torch.equal(back, t)


def test_pack_state_uses_global_keys() -> None:
    stage = Stage(torch.device("cpu"), None, 0)
    stage.add_layer(7, torch.nn.BatchNorm1d(3))
    meta, buffers = pack_state(stage)
    keys = [m["key"] for m in meta]
    assert "7.weight" in keys and "7.running_mean" in keys and len(buffers) == len(meta)
