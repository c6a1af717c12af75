"""Sizes a later unit needs are read off the tensors it receives (the batch and sequence length ride on the hidden
state), so only tensors cross a stage boundary, and a unit captured for any batch size runs at another."""

from __future__ import annotations

import torch

from vpipe_lab.runtime.model.capture import capture
from vpipe_lab.runtime.model.sizes import is_size


class Reshaper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        for block in self.blocks:
            x = block(x).reshape(b * t, 6).reshape(b, t, 6)  # every block uses the sizes the first one read
        return x


def test_later_units_read_sizes_off_what_they_receive() -> None:
    chain = capture(Reshaper(), torch.zeros(2, 5, 6))
    for unit in chain.units[1:]:
        placeholders = [n for n in unit.graph.graph.nodes if n.op == "placeholder"]
        assert not any(is_size(n) for n in placeholders)  # no size crosses a boundary: each is read again here
    carry = chain.start(torch.ones(3, 4, 6))  # another batch and length than captured
    for unit in chain.units:
        carry = unit(carry)
    assert chain.finish(carry).shape == (3, 4, 6)
