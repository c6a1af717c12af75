"""Mixture-of-experts layers found in a captured model, and the tokens each expert receives counted from its
router's picks: exactly, once per training forward, with tokens over a capacity counted as dropped."""

from __future__ import annotations

import torch
from torch import nn

from tests.models import zoo
from vpipe_lab.runtime.model import experts
from vpipe_lab.runtime.model.capture import capture


class Router(nn.Module):
    def __init__(self, width: int, count: int, capacity: int | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(width, count, bias=False)
        if capacity is not None:
            self.expert_capacity = capacity

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)


class Experts(nn.Module):
    """Stacked expert weights, applied densely and weighted by the routing (exportable: no data-dependent shapes)."""

    def __init__(self, width: int, count: int) -> None:
        super().__init__()
        self.num_experts = count
        self.w = nn.Parameter(torch.randn(count, width, width) * 0.1)

    def forward(self, h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        every = torch.einsum("...d,edf->...ef", h, self.w)
        return (every * weights.unsqueeze(-1)).sum(-2)


class TopK(nn.Module):
    """A Mixtral-style layer over a flat list of tokens: top-2 of 4 experts."""

    def __init__(self, width: int = 8, count: int = 4, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.gate = Router(width, count)
        self.experts = Experts(width, count)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        probs = self.gate(flat).softmax(-1)
        top, idx = torch.topk(probs, self.k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, idx, top)
        return h + self.experts(flat, weights).reshape(h.shape)


class Switch(nn.Module):
    """A Switch-style layer: top-1 by argmax over [batch, sequence], a capacity per sequence."""

    def __init__(self, width: int = 8, count: int = 4, capacity: int = 2) -> None:
        super().__init__()
        self.router = Router(width, count, capacity)
        self.experts = Experts(width, count)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = self.router(h).softmax(-1)
        choice = torch.nn.functional.one_hot(probs.argmax(-1), probs.shape[-1])
        kept = choice * (torch.cumsum(choice, dim=-2) <= self.router.expert_capacity)  # per sequence, in order
        return h + self.experts(h, kept * probs)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([Block(TopK()), Block(Switch())])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Block(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(h)


def run(chain, x):  # type: ignore[no-untyped-def]
    carry = chain.start(x)
    for unit in chain.units:
        carry = unit(carry)
    return chain.finish(carry)


def test_find_names_each_moe_layer_with_its_expert_count_and_capacity() -> None:
    assert experts.find(Net()) == {"blocks.0.mlp": (4, None), "blocks.1.mlp": (4, 2)}
    torch.manual_seed(0)
    mixtral = zoo.mixtral()
    found = experts.find(mixtral)
    assert list(found) == [f"model.layers.{i}.mlp" for i in range(4)] and set(found.values()) == {(4, None)}
    assert not experts.find(zoo.llama())  # a dense model has none


def test_the_counts_are_the_router_s_picks_once_per_training_forward_and_dropped_over_capacity() -> None:
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 5, 8)  # 3 sequences of 5 tokens
    chain = capture(net.train(), x)
    assert [(m.module, m.experts, m.top_k, m.capacity, m.unit) for m in chain.experts] == [
        ("blocks.0.mlp", 4, 2, None, 1), ("blocks.1.mlp", 4, 1, 2, 2)]
    experts.take()
    run(chain, x)  # outside a training forward: not counted (recompute, probes, evaluation)
    assert experts.take() == {}
    with experts.counting():
        out = run(chain, x)
    torch.testing.assert_close(out, net(x))  # counting changes nothing computed
    got = experts.take()
    # what the model's own routers pick, counted by hand
    h = net.embed(x)
    top = torch.topk(net.blocks[0].mlp.gate(h.reshape(-1, 8)).softmax(-1), 2, dim=-1).indices
    assert got["blocks.0.mlp"] == {"tokens": torch.bincount(top.reshape(-1), minlength=4).tolist(), "dropped": None}
    h = net.blocks[0](h)
    choice = net.blocks[1].mlp.router(h).softmax(-1).argmax(-1)  # [3, 5]
    per_sequence = torch.stack([torch.bincount(row, minlength=4) for row in choice])
    assert got["blocks.1.mlp"]["tokens"] == per_sequence.clamp(max=2).sum(0).tolist()
    assert got["blocks.1.mlp"]["dropped"] == (per_sequence - 2).clamp(min=0).sum(0).tolist()
    assert sum(got["blocks.1.mlp"]["tokens"]) + sum(got["blocks.1.mlp"]["dropped"]) == 15
    assert experts.take() == {}  # taken: counting starts again


def test_a_transformers_moe_model_is_counted_where_its_router_picks() -> None:
    """Mixtral: top-2 of 4 experts over the flattened tokens; every token counted twice, nothing dropped."""
    torch.manual_seed(0)
    model = zoo.mixtral()
    x, _ = zoo.lm_data(0)
    chain = capture(model.train(), x)
    assert [m.module for m in chain.experts] == [f"model.layers.{i}.mlp" for i in range(4)]
    assert all(m.top_k == 2 and m.unit == i + 1 for i, m in enumerate(chain.experts))
    experts.take()
    with experts.counting():
        run(chain, x)
    got = experts.take()
    assert all(sum(v["tokens"]) == 2 * x["input_ids"].numel() and v["dropped"] is None for v in got.values())
    assert chain.infos()[1]["moe"] == [{"module": "model.layers.0.mlp", "experts": 4, "top_k": 2, "capacity": None}]


def test_deepseek_s_group_top_k_is_passed_over_for_the_experts_pick() -> None:
    torch.manual_seed(0)
    model = zoo.deepseek_v3()
    x, _ = zoo.lm_data(0)
    chain = capture(model.train(), x)
    # layer 0 is dense (first_k_dense_replace); the others pick 2 of 4 routed experts (not 1 of 2 groups)
    assert [(m.module, m.experts, m.top_k) for m in chain.experts] == [
        (f"model.layers.{i}.mlp", 4, 2) for i in (1, 2, 3)]
