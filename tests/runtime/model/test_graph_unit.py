"""Captured units: an eval-mode copy over the same parameters, and a copy of any input the unit writes in place."""

from __future__ import annotations

import torch

from vpipe_lab.runtime.model.capture import capture
from vpipe_lab.runtime.model.graph_unit import for_inference, written_inputs


def test_inference_copy_runs_a_captured_unit_in_eval_mode() -> None:
    """torch.export bakes training mode into the graph: the inference copy turns dropout off, uses batch norm's
    running statistics and leaves every buffer as it was, like ``model.eval()`` on the original."""
    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4),
                                                                  torch.nn.Dropout(0.5)) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model = Blocks().train()
    chain = capture(model, torch.randn(8, 4))
    x = torch.randn(8, 4)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        carry = chain.start(x)
        for unit in chain.units:
            run, back = for_inference(unit)
            assert not back
            carry = run(carry)
        out = chain.finish(carry)
        expected = model.eval()(x)
    torch.testing.assert_close(out, expected)
    for key, value in model.state_dict().items():
        assert torch.equal(value, buffers[key]), key


class AddBias(torch.nn.Module):
    """Adds its bias into what it is given, in place (as a residual ``add_`` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.b)


class InPlaceStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lins = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(3)])
        self.adds = torch.nn.ModuleList([AddBias() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, add in zip(self.lins, self.adds):
            x = add(lin(x))
        return x


def test_a_unit_that_writes_what_it_receives_gets_a_copy() -> None:
    """Cut where a unit adds into the tensor it receives: across a stage boundary that tensor is a leaf of the
    stage's own graph, which an in-place op may not change; the unit gets a copy, and the gradients are plain
    PyTorch's."""
    torch.manual_seed(0)
    model = InPlaceStack()
    x = torch.randn(4, 6)
    chain = capture(model, x, split=["adds.1", "adds.2"])
    assert [bool(u.copy_keys) for u in chain.units] == [False, True, True]
    assert [written_inputs(u.graph) for u in chain.units] == [u.copy_keys for u in chain.units]
    carry, runs = chain.start(x), []
    for unit in chain.units:  # as stages run them: each unit's input a fresh leaf
        leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in carry.items()}
        carry = unit(leaves)
        runs.append((leaves, carry))
    chain.finish(carry).sum().backward()
    for (_, out), (after, _) in zip(reversed(runs[:-1]), reversed(runs[1:])):  # each gradient sent back a stage
        keys = [k for k, v in after.items() if v.grad is not None]
        torch.autograd.backward([out[k] for k in keys], [after[k].grad for k in keys])
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, want in zip(grads, model.parameters()):
        torch.testing.assert_close(got, want.grad)
