import torch

from vpipe_lab.runtime.memory.recompute import detach, forward_without_saving, leafify, rematerialise


def test_rematerialise_replays_dropout_and_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Dropout(0.5))
    x = torch.randn(3, 5)
    torch.manual_seed(42)
    ref_out = module(x.clone().requires_grad_())
    ref_out.sum().backward()
    ref_grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()

    torch.manual_seed(42)
    out, saved = forward_without_saving(module, x, torch.device("cpu"))
    assert not out.requires_grad
    torch.rand(100)  # other work consumes the RNG in between
    leaves, again = rematerialise(module, saved)
    torch.testing.assert_close(again, ref_out)
    again.sum().backward()
    for p, g in zip(module.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g)
    assert leaves[0].grad is not None


def test_leafify_keeps_structure_and_skips_integers() -> None:
    value = (torch.ones(2), torch.tensor([1, 2]))
    struct, leaves = leafify(value)
    assert isinstance(struct, tuple) and struct[0].requires_grad and not struct[1].requires_grad
    assert len(leaves) == 1
    assert not detach(struct)[0].requires_grad
