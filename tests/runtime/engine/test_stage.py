import pytest
import torch

from vpipe_lab.core.plan import Policy
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.model.units import layer_seed


def build(policies: list[Policy]) -> Stage:
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(3)]
    stage = Stage(torch.device("cpu"), lambda p: torch.optim.SGD(p, lr=0.1), seed=0)
    for i, layer in enumerate(layers):
        stage.add_layer(i, layer)
    stage.set_policies(dict(enumerate(policies)))
    return stage


def run(stage: Stage, x: torch.Tensor, profile: bool = False) -> list[torch.Tensor]:
    clock = (lambda: 0.0) if profile else None
    h = x
    segments = stage.segments(profile)
    for segment in segments:
        h = stage.forward(0, segment, h, timer=clock)
    grads = (torch.ones_like(h),)
    for segment in reversed(segments):
        grads = stage.backward(0, segment, grads, clock)
    return [p.grad.clone() for i in stage.owned for p in stage.layers[i].module.parameters()]


def test_segments_are_runs_of_kept_or_swapped_layers_and_recomputed_layers_alone() -> None:
    stage = build([Policy.KEEP, Policy.KEEP, Policy.RECOMPUTE])
    assert stage.segments() == [(0, 1), (2,)]
    assert stage.segments(profile=True) == [(0,), (1,), (2,)]
    stage.set_policies({2: Policy.KEEP})
    assert stage.segments() == [(0, 1, 2)]
    stage.set_policies({1: Policy.SWAP})
    assert stage.segments() == [(0,), (1,), (2,)]
    stage.set_policies({0: Policy.RECOMPUTE, 1: Policy.RECOMPUTE, 2: Policy.RECOMPUTE})
    assert stage.segments() == [(0,), (1,), (2,)]  # each keeps its own input, to be rebuilt before its own backward


def test_a_fused_segment_is_one_backward_and_profiling_fills_every_layers_stats() -> None:
    stage = build([Policy.KEEP] * 3)
    calls = []
    original = torch.autograd.backward

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        return original(*args, **kwargs)

    torch.autograd.backward = counting
    try:
        run(stage, torch.randn(4, 6))
        assert len(calls) == 1
        assert all(stage.layers[i].stats.forwards == 0 for i in stage.owned)  # no per-layer timing when fused
        run(stage, torch.randn(4, 6), profile=True)
        assert len(calls) == 4
    finally:
        torch.autograd.backward = original
    assert all(stage.layers[i].stats.forwards == 1 and stage.layers[i].stats.backwards == 1 for i in stage.owned)
    assert all(stage.layers[i].stats.activation_bytes > 0 for i in stage.owned)


@pytest.mark.parametrize("profile", [False, True])
@pytest.mark.parametrize("policies", [["keep"] * 3, ["recompute"] * 3, ["swap", "keep", "recompute"],
                                      ["swap", "swap", "keep"]])
def test_layerwise_backward_matches_autograd(policies: list[str], profile: bool) -> None:
    x = torch.randn(4, 6)
    ref = build([Policy.KEEP] * 3)
    h = x
    for i in ref.owned:
        h = ref.layers[i].module(h)
    h.sum().backward()
    expected = [p.grad.clone() for i in ref.owned for p in ref.layers[i].module.parameters()]
    stage = build([Policy.parse(p) for p in policies])
    got = run(stage, x, profile)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)  # the same operations in the same order: bit for bit
    assert stage.ledger.current == 0  # everything released after backward


def test_recompute_holds_only_the_input() -> None:
    keep, rec = build([Policy.KEEP] * 3), build([Policy.RECOMPUTE] * 3)
    x = torch.randn(4, 6)
    for stage in (keep, rec):
        h = x
        for segment in stage.segments(profile=True):
            h = stage.forward(0, segment, h)
    assert rec.ledger.current == 3 * 4 * 6 * 4  # three saved inputs
    fused = build([Policy.RECOMPUTE] * 3)
    fused.forward(0, fused.segments()[0], x)
    assert fused.ledger.current == 4 * 6 * 4  # a recomputed segment keeps only its own input
    assert keep.ledger.current > rec.ledger.current


def test_step_discard_and_static_bytes() -> None:
    stage = build([Policy.KEEP] * 3)
    before = [p.clone() for p in stage.layers[0].module.parameters()]
    run(stage, torch.randn(2, 6))
    assert stage.static_bytes()["grads"] > 0
    stage.discard()
    assert stage.static_bytes()["grads"] == 0
    for a, b in zip(stage.layers[0].module.parameters(), before):
        torch.testing.assert_close(a, b)
    run(stage, torch.randn(2, 6))
    stage.step()
    assert any(not torch.equal(a, b) for a, b in zip(stage.layers[0].module.parameters(), before))
    moved = stage.remove_layer(0)
    assert 0 not in stage.layers and moved.module is not None
    assert {n for n, _ in stage.params()} == {"1.0.weight", "1.0.bias", "2.0.weight", "2.0.bias"}


def test_a_tied_weight_is_one_tensor_with_one_update() -> None:
    """Two layers sharing a weight: one registry entry, one optimizer entry, the gradient summed over both uses."""
    torch.manual_seed(0)
    first, last = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
    last.weight = first.weight
    model = torch.nn.Sequential(first, torch.nn.Tanh(), last)
    ref = [p.clone() for p in model.parameters()]
    stage = Stage(torch.device("cpu"), lambda p: torch.optim.SGD(p, lr=0.1), seed=0)
    from vpipe_lab.runtime.model.capture import capture

    chain = capture(model, None)
    for i, unit in enumerate(chain.units):
        stage.add_layer(i, unit, chain.tensors[i])
    assert [n for n, _ in stage.params()] == ["0.weight"]
    assert len(stage.optimizer.param_groups[0]["params"]) == 1  # type: ignore[union-attr]
    x = torch.randn(3, 4)
    run(stage, x)
    stage.step()
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Tanh(), torch.nn.Linear(4, 4, bias=False))
    plain[0].weight = plain[2].weight = torch.nn.Parameter(ref[0].clone())
    plain(x).sum().backward()
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    torch.testing.assert_close(stage.tensors["0.weight"], plain[0].weight)


def test_layer_seed_is_distinct_per_coordinate() -> None:
    seeds = {layer_seed(0, it, mb, layer) for it in range(3) for mb in range(3) for layer in range(3)}
    assert len(seeds) == 27
