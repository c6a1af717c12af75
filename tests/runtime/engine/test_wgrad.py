"""Linear layers that accumulate weight gradients inside the GEMM give plain autograd's gradients."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from vpipe_lab.runtime.engine import wgrad


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 16, bias=False),
                               torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _accumulate(model: torch.nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradient accumulation over micro-batches; the inputs' gradients of each."""
    grads = []
    for x in inputs:
        x = x.clone().requires_grad_()
        model(x).square().mean().backward()
        assert x.grad is not None
        grads.append(x.grad)
    return grads


def _assert_trains_alike(plain: torch.nn.Module, fused: torch.nn.Module, inputs: list[torch.Tensor]) -> None:
    """Accumulating over ``inputs`` gives both the same input and parameter gradients."""
    for g, h in zip(_accumulate(plain, inputs), _accumulate(fused, inputs)):
        torch.testing.assert_close(h, g)
    _assert_same_grads(plain, fused)


def _assert_same_grads(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("shape", [(4, 8), (2, 5, 8)])
def test_gradients_match_plain_autograd_over_microbatches(shape: tuple[int, ...]) -> None:
    plain = _model()
    fused = copy.deepcopy(plain)
    assert wgrad.fuse(fused, 0) == 3
    inputs = [torch.randn(shape) for _ in range(4)]
    _assert_trains_alike(plain, fused, inputs)


def test_the_weight_gradient_is_accumulated_in_place() -> None:
    """After the first micro-batch the same gradient tensor is added to (no new tensor per micro-batch)."""
    model = _model()
    wgrad.fuse(model, 0)
    weight = model[0].weight
    _accumulate(model, [torch.randn(4, 8)])
    assert weight.grad is not None
    held, ptr = weight.grad, weight.grad.data_ptr()
    _accumulate(model, [torch.randn(4, 8) for _ in range(3)])
    assert weight.grad is held and weight.grad.data_ptr() == ptr


def test_gradients_reach_the_parameters_through_saved_tensor_hooks() -> None:
    """The stage records saved tensors with hooks that may unpack another tensor object over the weight's data; the
    gradient must still land on the parameter itself."""
    plain = _model()
    fused = copy.deepcopy(plain)
    wgrad.fuse(fused, 0)
    inputs = [torch.randn(4, 8) for _ in range(3)]
    _accumulate(plain, inputs)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
        _accumulate(fused, inputs)
    _assert_same_grads(plain, fused)


def test_runs_the_plain_forward_where_it_does_not_apply() -> None:
    model = _model()
    wgrad.fuse(model, 0)
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = model(x)
    assert out.grad_fn is None
    model[0].weight.requires_grad_(False)  # a frozen layer: autograd as usual, no gradient appears
    model(x).sum().backward()
    assert model[0].weight.grad is None and model[2].weight.grad is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: the module's own (casting) forward
        y = model(x)
    assert y.dtype == torch.bfloat16


def test_suspended_lets_autograd_grad_see_the_weights_without_touching_grad() -> None:
    plain, fused = _model(), _model()
    wgrad.fuse(fused, 0)
    x = torch.randn(4, 8)
    with wgrad.suspended():
        got = torch.autograd.grad(fused(x).sum(), list(fused.parameters()))
    want = torch.autograd.grad(plain(x).sum(), list(plain.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert all(p.grad is None for p in fused.parameters())


def test_a_weight_tied_to_an_embedding_gets_both_gradients() -> None:
    def tied() -> torch.nn.Module:
        torch.manual_seed(0)
        emb, head = torch.nn.Embedding(10, 6), torch.nn.Linear(6, 10, bias=False)
        head.weight = emb.weight
        return torch.nn.Sequential(emb, torch.nn.Tanh(), head)

    plain, fused = tied(), tied()
    wgrad.fuse(fused, 0)
    for _ in range(3):
        tokens = torch.randint(0, 10, (3, 4))
        plain(tokens).square().mean().backward()
        fused(tokens).square().mean().backward()
    torch.testing.assert_close(fused[0].weight.grad, plain[0].weight.grad)


def test_huggingface_conv1d_is_fused_too() -> None:
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    plain = torch.nn.Sequential(pytorch_utils.Conv1D(12, 8), torch.nn.ReLU(), pytorch_utils.Conv1D(4, 12))
    fused = copy.deepcopy(plain)
    assert wgrad.fuse(fused, 0) == 2
    inputs = [torch.randn(2, 3, 8) for _ in range(3)]
    _assert_trains_alike(plain, fused, inputs)


def test_copies_and_saved_modules_run_over_themselves_and_unfuse_restores() -> None:
    model = _model()
    wgrad.fuse(model, 0)
    copied = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (copied, loaded):
        with torch.no_grad():
            other[0].weight.add_(1.0)  # the copy's own weights, not the original's
        x = torch.randn(2, 8)
        torch.testing.assert_close(other(x), torch.nn.Sequential(*[copy.deepcopy(m) for m in other])(x))
        assert not torch.allclose(other(x), model(x))
    wgrad.unfuse(model)
    assert "forward" not in model[0].__dict__
    assert wgrad.fuse(model, 0) == 3


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_a_captured_graphs_linear_ops_are_fused_and_unfused() -> None:
    """A torch.export-ed model (how runtime/model/capture.py takes any nn.Module) calls aten.linear on its parameters."""
    torch.manual_seed(0)
    plain = _Net()
    graph = torch.export.export(copy.deepcopy(plain), (torch.randn(3, 8),)).module()
    assert isinstance(graph, torch.fx.GraphModule)
    assert wgrad.fuse(graph, 0) == 2 and wgrad.fuse(graph, 0) == 2
    assert sum(n.target is wgrad.graph_linear for n in graph.graph.nodes) == 2
    inputs = [torch.randn(3, 8) for _ in range(3)]
    _assert_trains_alike(plain, graph, inputs)
    wgrad.unfuse(graph)
    assert sum(n.target is torch.ops.aten.linear.default for n in graph.graph.nodes) == 2


def test_an_exported_conv1d_addmm_is_fused() -> None:
    """GPT-2's Conv1D exports as aten.addmm(bias, x, W)."""
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    plain = torch.nn.Sequential(pytorch_utils.Conv1D(12, 8), torch.nn.Tanh())
    graph = torch.export.export(copy.deepcopy(plain), (torch.randn(6, 8),)).module()
    assert wgrad.fuse(graph, 0) == 1
    inputs = [torch.randn(6, 8) for _ in range(3)]
    _assert_trains_alike(plain, graph, inputs)


def test_only_weights_of_at_least_min_params_are_fused() -> None:
    model = _model()  # weights of 256, 512 and 64 elements
    assert wgrad.fuse(model, 300) == 1
    assert isinstance(model[2].forward, wgrad._Forward)
    assert "forward" not in model[0].__dict__ and "forward" not in model[4].__dict__
    assert wgrad.fuse(_model()) == 0  # the default leaves cache-sized weights to autograd
    assert wgrad.threshold(True) == wgrad.MIN_PARAMS and wgrad.threshold(False) is None and wgrad.threshold(0) == 0


def test_a_deferred_backward_leaves_the_weight_gemms_for_the_w_step() -> None:
    """B computes the input's gradient only; the weights' gradients appear when W runs, equal to plain autograd's,
    over several micro-batches whose W steps run in another order than their B steps."""
    plain, split = _model(), _model()
    wgrad.fuse(split, 0)
    torch.manual_seed(1)
    inputs = [torch.randn(5, 8) for _ in range(3)]
    expected = _accumulate(plain, inputs)
    store = wgrad.Deferred()
    got = []
    for mb, x in enumerate(inputs):
        x = x.clone().requires_grad_()
        with store.collecting(mb, None) as added:
            split(x).square().mean().backward()
        assert len(added) == 3 and x.grad is not None  # one GEMM per linear layer, the input's gradient now
        got.append(x.grad)
        assert split[0].weight.grad is None and split[4].bias.grad is None  # weights wait for W (LayerNorm does not)
        assert split[3].weight.grad is not None
    assert wgrad.held_bytes(store.pending[0]) > 0
    timed: list[tuple[int | None, float]] = []
    for mb in (2, 0, 1):
        store.step(mb, timer=lambda: 0.0, took=lambda layer, seconds: timed.append((layer, seconds)))
    assert store.pending == {} and timed == [(None, 0.0)] * 3
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    for a, b in zip(split.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_routed_elements_say_what_a_split_would_defer() -> None:
    model = _model()  # Linear(8, 32), Linear(32, 16), Linear(16, 4): 256, 512 and 64 weight elements
    assert wgrad.routed_elements(model, 0) == (832, 832)
    assert wgrad.routed_elements(model, 256) == (768, 832)
    exported = torch.export.export(torch.nn.Sequential(torch.nn.Linear(8, 32)), (torch.randn(2, 8),)).module()
    assert wgrad.routed_elements(exported, 0) == (256, 256)  # a captured graph's aten.linear counts too
