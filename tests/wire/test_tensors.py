"""The tensor format of the control channel: every dtype survives encode -> message -> decode."""

import torch

from vpipe_lab.wire.codec import decode as decode_message
from vpipe_lab.wire.events import Tensors
from vpipe_lab.wire.tensors import TensorMeta, decode, encode


def test_round_trip_of_dtypes_through_a_message() -> None:
    for t in (torch.randn(3, 2), torch.arange(5), torch.tensor([True, False]), torch.randn(2).to(torch.bfloat16),
              torch.tensor(3.5), torch.zeros(0, 4)):
        meta, raw = encode("k", t)
        got = decode_message(Tensors(1, 0, [meta], [raw]).message())
        assert isinstance(got, Tensors) and got.tensors == [meta]
        back = decode(got.tensors, got.buffers)["k"]
        assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_metadata_says_key_dtype_and_shape() -> None:
    meta, raw = encode("w", torch.ones(2, 3, dtype=torch.float16))
    assert meta == TensorMeta("w", "float16", [2, 3]) and len(raw) == 12
