"""A model laid out on the meta device is captured as if it sat on its stage's device: code that branches on the
device takes the run device's branch, and the layout keeps its own meta tensors (ties included)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vpipe_lab.runtime.build import on_meta
from vpipe_lab.runtime.model.capture import capture
from vpipe_lab.runtime.model.trace.run_device import holds_meta, inputs_on, restore, seen_on
from vpipe_lab.runtime.model.units import set_tensor


class DeviceBranch(nn.Module):
    """Counts tokens per bucket as transformers' MoE layers do: ``torch.histc`` on floats on CPU (its CPU kernel has
    no integer version), on ints elsewhere; and scales by a device-dependent factor, so the branch shows in values."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        on_cpu = h.device.type in ("cpu", "mps")
        ids = h.argmax(-1).reshape(-1)
        counts = torch.histc(ids.float() if on_cpu else ids.int(), bins=4, min=0, max=3)
        return self.head(h * (2.0 if on_cpu else 3.0)) + counts.sum() * 0


def _branch(nodes) -> tuple[torch.dtype, float]:  # type: ignore[no-untyped-def]
    """What the traced code chose: the dtype ``histc`` counts in and the factor the hidden state is scaled by."""
    nodes = list(nodes)
    histc = next(n for n in nodes if str(n.target) == "aten.histc.default")
    scale = next(n for n in nodes if str(n.target) == "aten.mul.Tensor" and isinstance(n.args[1], float))
    return histc.args[0].meta["val"].dtype, scale.args[1]


def test_a_meta_layout_is_captured_with_the_cpu_branch_and_computes_what_the_model_does() -> None:
    torch.manual_seed(0)
    real = DeviceBranch()
    meta, _ = on_meta(DeviceBranch, 0)
    chain = capture(meta.train(), torch.zeros(2, 4, device="meta"), split=["proj", "head"],
                    device=torch.device("cpu"))
    assert all(t.is_meta for u in chain.units for t in u.parameters())  # the layout still holds no memory
    assert _branch(n for u in chain.units for n in u.graph.graph.nodes) == (torch.float32, 2.0)  # the CPU's
    for i, unit in enumerate(chain.units):  # give the units the real model's tensors and run them
        for local, name in chain.tensors[i].params + chain.tensors[i].buffers:
            set_tensor(unit, local, dict(real.named_parameters())[name])
    x = torch.randn(3, 4)
    carry = chain.start(x)
    for unit in chain.units:
        carry = unit(carry)
    torch.testing.assert_close(chain.finish(carry), real(x))


def test_without_the_run_device_a_meta_trace_would_take_another_device_s_branch() -> None:
    """What the lab did before: traced on meta tensors, the model's ``device.type`` is "meta", not "cpu", so the
    graph holds the integer histogram that CPU cannot run ("histogram_cpu" not implemented for 'Int')."""
    meta, _ = on_meta(DeviceBranch, 0)
    exported = torch.export.export(meta.train(), (torch.zeros(2, 4, device="meta"),), strict=False)
    assert _branch(exported.graph.nodes) == (torch.int32, 3.0)


def test_seen_on_swaps_meta_tensors_for_fakes_of_the_device_and_puts_them_back_ties_included() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False), nn.BatchNorm1d(5))
    model[1].weight = model[0].weight  # a tie: one tensor under two names
    before = {n: t for n, t in list(model.named_parameters(remove_duplicate=False)) +
              list(model.named_buffers(remove_duplicate=False))}
    assert holds_meta(model)
    with seen_on(model, torch.device("cpu")) as originals:
        assert model[0].weight is model[1].weight  # still one tensor
        assert model[0].weight.device.type == "cpu" and not model[0].weight.is_meta
        assert isinstance(model[0].weight, nn.Parameter) and model[0].weight.requires_grad
        assert model[2].running_mean.device.type == "cpu"
        inner = nn.Module()
        inner.w = model[0].weight  # a module made inside (an exported graph) holding a fake
        restore(inner, originals)
        assert inner.w is before["0.weight"]
    after = dict(list(model.named_parameters(remove_duplicate=False)) +
                 list(model.named_buffers(remove_duplicate=False)))
    assert all(after[n] is t for n, t in before.items())


def test_inputs_on_makes_zeros_on_the_device_from_meta_and_leaves_the_rest() -> None:
    got = inputs_on({"ids": torch.empty(2, 3, dtype=torch.long, device="meta"), "flag": True,
                     "real": torch.ones(1)}, torch.device("cpu"))
    assert got["ids"].device.type == "cpu" and got["ids"].dtype == torch.long and not got["ids"].any()
    assert got["flag"] is True and torch.equal(got["real"], torch.ones(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the CUDA branch (benchmarks/gpu_check.py)")
def test_on_a_gpu_the_capture_takes_the_cuda_branch() -> None:
    meta, _ = on_meta(DeviceBranch, 0)
    chain = capture(meta.train(), torch.zeros(2, 4, device="meta"), split=["proj", "head"],
                    device=torch.device("cuda", 0))
    assert _branch(n for u in chain.units for n in u.graph.graph.nodes) == (torch.int32, 3.0)
