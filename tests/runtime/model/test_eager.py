"""Parts torch.export cannot trace run eagerly inside their unit (``runtime/model/trace/eager.py``): a block whose submodule
branches on a tensor's values is captured with that submodule called as PyTorch calls it, the chain computing exactly
what the model computes (outputs and gradients, at other shapes too); a branch in the model's own forward, or in a
module that holds the split points, is still refused with the line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.runtime.model.test_capture import run_chain
from vpipe_lab.runtime.model.capture import CaptureError, capture


class Skipping(nn.Module):
    """Experts that skip what received nothing: a loop over the values of a tensor (no single graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = x.sum(-1).long().remainder(3)
        out = torch.zeros_like(x)
        for e in choice.unique():  # only the experts some row chose
            rows = choice == e
            out[rows] = self.experts[int(e)](x[rows])
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.moe = Skipping()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class Net(nn.Module):
    def __init__(self, branch_outside: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 2)
        self.branch_outside = branch_outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
            if self.branch_outside and bool((h > 100).any()):  # between blocks: no unit can hold it
                h = h / 2
        return self.head(h)


class Stack(nn.Module):
    """The blocks inside a module whose own forward branches on values: running it eagerly would span units."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if bool((x > 100).any()):
                x = x / 2
        return x


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.stack, self.head = nn.Linear(4, 8), Stack(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.inp(x)))


def test_a_block_with_a_branch_on_values_runs_its_part_eagerly_and_computes_what_the_model_does() -> None:
    torch.manual_seed(0)
    model = Net().train()
    x = torch.randn(6, 4)
    chain = capture(model, x)
    assert chain.names == ["inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert chain.eager == {i + 1: [f"blocks.{i}.moe"] for i in range(4)}
    assert [info.get("eager") for info in chain.infos()] == [None, *[[f"blocks.{i}.moe"] for i in range(4)], None]
    assert "forward" not in vars(model.blocks[0].moe)  # the stand-in is gone: the module is as it was
    out = run_chain(chain, x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model(x).square().sum().backward()
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, msg=n)
    other = torch.randn(11, 4)  # another batch size: the same graph, the eager part at its own shapes
    torch.testing.assert_close(run_chain(chain, other), model(other), rtol=0, atol=0)


def test_a_branch_between_blocks_or_around_them_is_refused_with_the_line() -> None:
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match=r"test_eager.py:\d+ in forward.*branch_outside"):
        capture(Net(branch_outside=True), torch.randn(6, 4))
    with pytest.raises(CaptureError, match=r"stack holds the split points \['stack.blocks.0'"):
        capture(Wrapped(), torch.randn(6, 4), split=["stack.blocks.0", "stack.blocks.1"])


def test_a_second_capture_of_the_model_does_not_fail_its_whole_trace_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 cuts the model alone, then builds its stage: the class found untraceable the first time runs eagerly
    from the start the second time (one trace, not a failed one and another), to the same chain."""
    first = capture(Net().train(), torch.randn(6, 4))
    calls: list[int] = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or real(*a, **k))
    second = capture(Net().train(), torch.randn(6, 4))
    assert calls == [1] and second.eager == first.eager and second.signature() == first.signature()
