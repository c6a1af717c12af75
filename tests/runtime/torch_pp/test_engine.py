"""The torch engine's activation count: what autograd saves for backward, at its peak, freed as the backward lets go
(the session-level behaviour is in tests/integration/test_torch_engine.py)."""

from __future__ import annotations

import torch

from vpipe_lab.runtime.torch_pp.engine import SavedBytes


def test_saved_bytes_rise_with_forwards_and_fall_with_backwards() -> None:
    counter = SavedBytes()
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    with counter.hooks():
        first = torch.tanh(layer(x)).sum()
        one = counter.live
        second = torch.tanh(layer(x)).sum()
        two = counter.live
        first.backward()
        del first
        after = counter.live
        second.backward()
        del second
    assert one > 0 and two == 2 * one and counter.peak == two  # two micro-batches held at once
    assert after == one and counter.live == 0
    assert one >= 2 * 64 * 256 * 4  # at least the input and the tanh output, in float32
