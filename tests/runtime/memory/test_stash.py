import pytest
import torch

from vpipe_lab.runtime.memory.stash import WeightStash


def test_a_backward_uses_the_weights_its_forward_used_while_updates_go_on() -> None:
    """Micro-batches 0 and 1 run forward on version 0; the update after 0's backward moves the live weights off the
    memory 1 still reads (one stashed copy, its bytes counted), so 1's gradient is taken at version 0's weights, and
    the copy is freed with 1's backward."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    params = [("w", layer.weight), ("b", layer.bias)]
    names = [("weight", "w"), ("bias", "b")]
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    v0 = {n: p.detach().clone() for n, p in params}
    xs = [torch.randn(2, 4), torch.randn(2, 4)]
    stash = WeightStash()
    outs = []
    for mb in (0, 1):
        stash.begin(mb, params)
        outs.append(stash.call(layer, names, mb, xs[mb]).sum())
    assert stash.storages() == {layer.weight.untyped_storage().data_ptr(), layer.bias.untyped_storage().data_ptr()}
    outs[0].backward()
    assert stash.update(0, params, optimizer.step)  # 1 still in flight on version 0: the live weights moved
    assert stash.current == stash.peak == 4 * (12 + 3) and stash.version == 1
    expected_w = v0["w"] - 0.1 * xs[0].sum(0).expand(3, 4)
    torch.testing.assert_close(layer.weight.detach(), expected_w)
    assert layer.weight.grad is None
    outs[1].backward()  # no in-place error: version 0's memory was not written
    grad_w = stash.aliases[0]["w"].grad
    torch.testing.assert_close(grad_w, xs[1].sum(0).expand(3, 4))
    assert not stash.update(1, params, optimizer.step)  # nothing in flight: no copy
    assert stash.current == 0 and stash.aliases == {} and stash.reset_peak() == 60
    torch.testing.assert_close(layer.weight.detach(), expected_w - 0.1 * xs[1].sum(0).expand(3, 4))


def test_reset_forgets_every_version() -> None:
    layer = torch.nn.Linear(2, 2)
    stash = WeightStash()
    stash.begin(0, [("w", layer.weight)])
    stash.reset()
    assert stash.of_mb == {} and stash.aliases == {} and stash.version == 0
    with pytest.raises(KeyError):
        stash.call(layer, [("weight", "w")], 0, torch.zeros(1, 2))
