"""The input shapes a captured graph takes, read off torch.export's own graph."""

from __future__ import annotations

import sympy
import torch

from vpipe_lab.runtime.model.capture import args_kwargs
from vpipe_lab.runtime.model.input_shapes import InputRule, describe_leaves, dynamic_spec


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, flag: bool = True) -> torch.Tensor:
        return self.lin(x) * mask.unsqueeze(-1) if flag else self.lin(x)


def rule_for(example: dict) -> InputRule:  # type: ignore[type-arg]
    model = Net()
    args, kwargs = args_kwargs(example)
    exported = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_spec(model, args, kwargs),
                                   strict=False)
    return InputRule.of_graph(exported.module(), list(example.values()), exported.range_constraints)


def test_what_varies_stays_free_and_what_the_model_fixes_is_checked() -> None:
    rule = rule_for({"x": torch.zeros(4, 5, 6), "mask": torch.ones(4, 5), "flag": True})
    ok = describe_leaves([torch.zeros(3, 9, 6), torch.ones(3, 9), True])
    assert rule.problem(ok) is None  # batch and length are free
    assert rule.problem(describe_leaves([torch.zeros(1, 1, 6), torch.ones(1, 1), True])) is None  # torch's 0/1 rule
    assert "specialised to 6" in str(rule.problem(describe_leaves([torch.zeros(3, 9, 7), torch.ones(3, 9), True])))
    assert "ties to a size of 9" in str(rule.problem(describe_leaves([torch.zeros(3, 9, 6), torch.ones(3, 8), True])))
    assert "dtype" in str(rule.problem(describe_leaves([torch.zeros(3, 9, 6, dtype=torch.float64), torch.ones(3, 9),
                                                         True])))
    assert "captured as True" in str(rule.problem(describe_leaves([torch.zeros(3, 9, 6), torch.ones(3, 9), False])))
    assert "2 inputs" in str(rule.problem(describe_leaves([torch.zeros(3, 9, 6), torch.ones(3, 9)])))


def test_ranges_and_exact_rules() -> None:
    s = sympy.Symbol("s0", integer=True, positive=True)
    rule = InputRule([("tensor", torch.float32, (s, 4))], {s: (2, 32.0)})
    assert rule.problem([("tensor", torch.float32, (32, 4))]) is None
    assert "outside the graph's range [2, 32.0]" in str(rule.problem([("tensor", torch.float32, (33, 4))]))
    lower = InputRule([("tensor", torch.float32, (s,))], {s: (5, float("inf"))})
    assert "outside" in str(lower.problem([("tensor", torch.float32, (1,))]))  # a real lower bound holds for 0/1
    exact = InputRule.exactly([torch.zeros(2, 3), None])
    assert exact.problem(describe_leaves([torch.zeros(2, 3), None])) is None
    assert exact.problem(describe_leaves([torch.zeros(3, 3), None])) is not None
