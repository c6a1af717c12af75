import torch

from vpipe_lab.runtime.memory.ledger import Ledger
from vpipe_lab.runtime.memory.swap import SwapEngine


def layer() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())


def test_swap_out_moves_saved_bytes_to_the_host_and_back_with_the_same_gradients() -> None:
    x = torch.randn(4, 8)
    ref = layer()
    ref(x).sum().backward()

    module = layer()
    ledger = Ledger()
    engine = SwapEngine(torch.device("cpu"), ledger)
    engine.set_parameters(module)
    leaf = x.clone().requires_grad_(False)
    with engine.recording(0, 3):
        y = module(leaf)
    saved = ledger.current
    assert saved == 4 * 8 * 4 + 4 * 16 * 4  # Linear's input and Tanh's output; weights are never counted
    assert engine.swap_out(0, 3) == saved and ledger.current == 0 and ledger.host_current == saved
    assert engine.swap_in(0, 3) == saved and ledger.current == saved
    y.sum().backward()
    engine.release(0, 3)
    assert ledger.current == 0 and not engine.handles
    for a, b in zip(module.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_unpack_fetches_synchronously_when_not_prefetched() -> None:
    module = layer()
    engine = SwapEngine(torch.device("cpu"), Ledger())
    engine.set_parameters(module)
    with engine.recording(1, 0):
        y = module(torch.randn(2, 8))
    engine.swap_out(1, 0)
    y.sum().backward()  # no swap_in: the hook brings the tensors back itself
    assert all(p.grad is not None for p in module.parameters())
