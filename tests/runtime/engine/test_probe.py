import torch

from tests.runtime.engine.test_stage import run
from vpipe_lab.core.plan import Policy
from vpipe_lab.runtime.engine.probe import resize
from vpipe_lab.runtime.engine.stage import Stage


def test_probes_time_other_microbatch_sizes_and_leave_no_trace() -> None:
    """In a profiling iteration a probing stage times each layer on half and twice the micro-batch: the sizes are
    recorded, and no gradient, buffer or result of the real run changes."""
    def built(probing: bool) -> Stage:
        torch.manual_seed(0)
        stage = Stage(torch.device("cpu"), lambda p: torch.optim.SGD(p, lr=0.1), seed=0)
        stage.add_layer(0, torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)))
        stage.add_layer(1, torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()))
        stage.set_policies({0: Policy.KEEP, 1: Policy.KEEP})
        stage.probing = probing
        return stage

    x = torch.randn(8, 6)
    plain, probed = built(False), built(True)
    expected, got = run(plain, x, profile=True), run(probed, x, profile=True)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    for i in (0, 1):
        assert sorted(probed.layers[i].stats.sizes) == [4, 16]
        assert not plain.layers[i].stats.sizes
    for a, b in zip(plain.layers[0].module.buffers(), probed.layers[0].module.buffers()):
        assert torch.equal(a, b)


def test_a_layer_that_cannot_be_probed_is_left_linear() -> None:
    class FixedBatch(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(8, 6) * 2  # only runs on its own batch size

    stage = Stage(torch.device("cpu"), None, seed=0)
    stage.add_layer(0, FixedBatch())
    stage.set_policies({0: Policy.KEEP})
    stage.probing = True
    run(stage, torch.randn(8, 6), profile=True)
    run(stage, torch.randn(8, 6), profile=True)  # not tried again
    assert stage.layers[0].stats.sizes == {} and stage._unprobed == {0}


def test_resize_cuts_or_repeats_rows_and_leaves_other_tensors() -> None:
    t = torch.arange(6).reshape(3, 2)
    assert torch.equal(resize(t, 3, 2), t[:2])
    assert torch.equal(resize(t, 3, 7), torch.cat([t, t, t])[:7])
    other = torch.zeros(5, 2)
    assert resize(other, 3, 7) is other and resize(torch.tensor(1.0), 3, 7).dim() == 0
