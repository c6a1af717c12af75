import torch

from vpipe_lab.runtime.memory.ledger import Ledger
from vpipe_lab.runtime.memory.swap import SwapEngine


def layer() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())


def engine_for(module: torch.nn.Module) -> tuple[Ledger, SwapEngine]:
    ledger = Ledger()
    engine = SwapEngine(torch.device("cpu"), ledger)
    engine.set_parameters(module)
    return ledger, engine


def assert_gradients_of_a_plain_run(module: torch.nn.Module, x: torch.Tensor) -> None:
    ref = layer()
    ref(x).sum().backward()
    for a, b in zip(module.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_swap_out_moves_saved_bytes_to_the_host_and_back_with_the_same_gradients() -> None:
    x = torch.randn(4, 8)
    module = layer()
    ledger, engine = engine_for(module)
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
    assert_gradients_of_a_plain_run(module, x)


def test_unpack_fetches_synchronously_when_not_prefetched() -> None:
    module = layer()
    _, engine = engine_for(module)
    with engine.recording(1, 0):
        y = module(torch.randn(2, 8))
    engine.swap_out(1, 0)
    y.sum().backward()  # no swap_in: the hook brings the tensors back itself
    assert all(p.grad is not None for p in module.parameters())


def test_a_held_input_stays_on_the_device_and_only_the_rest_moves() -> None:
    """The segment's input is held by the stage for its backward anyway: a swap copies it nowhere (it would free
    nothing), counts it as still on the device, and the gradients are those of a plain run."""
    x = torch.randn(4, 8)
    module = layer()
    ledger, engine = engine_for(module)
    leaf = x.clone()
    with engine.recording(0, 3, held=frozenset({leaf.untyped_storage().data_ptr()})):
        y = module(leaf)
    held, rest = 4 * 8 * 4, 4 * 16 * 4  # Linear's input (the held leaf) and Tanh's output
    assert ledger.current == held + rest
    assert [h.nbytes for h in engine.handles[(0, 3)]] == [rest]  # only Tanh's output has a handle to move
    assert engine.swap_out(0, 3) == rest and ledger.current == held and ledger.host_current == rest
    assert engine.swap_in(0, 3) == rest and ledger.current == held + rest
    y.sum().backward()
    engine.release(0, 3)
    assert ledger.current == 0
    assert_gradients_of_a_plain_run(module, x)


class Gram(torch.nn.Module):
    """Saves one tensor twice over: ``h @ h.T`` keeps h and its transpose (one storage), and q, k cut from one
    projection keep two halves of another."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        q, k = h.chunk(2, dim=-1)
        return (h @ h.T).sum() + (q * k).sum()


def test_views_sharing_bytes_count_once_and_swap_as_one_copy() -> None:
    """h (4 x 16 floats) is saved as h, h.T, and as the halves q and k: 256 bytes once, not 4 x 256 / 2 + ... The swap
    copies those 256 bytes once (one span) and the backward's gradients are a plain run's."""
    torch.manual_seed(0)
    module, x = Gram(), torch.randn(4, 8)
    ledger, engine = engine_for(module)
    with engine.recording(0, 1, held=frozenset({x.untyped_storage().data_ptr()})):
        out = module(x)
    h_bytes = 4 * 16 * 4
    assert ledger.current == 4 * 8 * 4 + h_bytes  # the Linear's input (held) and h's bytes once
    assert [span.nbytes for span in engine.handles[(0, 1)]] == [h_bytes]
    assert engine.swap_out(0, 1) == h_bytes and engine.handles[(0, 1)][0].host.numel() == 4 * 16
    assert engine.swap_in(0, 1) == h_bytes
    out.backward()
    torch.manual_seed(0)
    ref = Gram()
    ref(x).backward()
    for a, b in zip(module.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_a_view_of_a_larger_tensor_counts_the_range_it_reaches() -> None:
    """A micro-batch is a chunk of the whole batch: a layer saving it holds (and a swap moves) its own rows only."""
    module = layer()
    ledger, engine = engine_for(module)
    batch = torch.randn(16, 8)
    with engine.recording(0, 0):
        y = module(batch[4:8])
    assert ledger.current == 4 * 8 * 4 + 4 * 16 * 4
    assert engine.swap_out(0, 0) == ledger.host_current == 4 * 8 * 4 + 4 * 16 * 4
    engine.swap_in(0, 0)
    y.sum().backward()
    assert_gradients_of_a_plain_run(module, batch[4:8])
