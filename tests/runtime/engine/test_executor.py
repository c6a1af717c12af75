"""One-stage pipelines run in-process (no communication), against plain full-batch training."""

import pytest
import torch

from tests.runtime import reference
from vpipe_lab.core.plan import Plan
from vpipe_lab.examples import mlp
from vpipe_lab.runtime.engine.comm import Peer
from vpipe_lab.runtime.engine.device import Clock, Placement
from vpipe_lab.runtime.engine.executor import Executor, default_loss
from vpipe_lab.runtime.engine.stage import Stage


def executor(policies: str, schedule: str, budget: int | None = None) -> tuple[Executor, Plan]:
    torch.manual_seed(0)
    model = mlp.model()
    stage = Stage(torch.device("cpu"), mlp.optimizer, seed=0)
    for i, layer in enumerate(model):
        stage.add_layer(i, layer)
    plan = Plan((0, 10), tuple(policies), 4, schedule)
    stage.set_policies(dict(enumerate(plan.policies)))
    placement = Placement(torch.device("cpu"), "gloo")
    return Executor(0, 1, stage, Peer(0, 1, torch.device("cpu"), 5), placement, Clock(), mlp.loss, budget), plan


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_single_stage_matches_plain_training(schedule: str) -> None:
    ex, plan = executor("ksrksrksrk", schedule)
    losses = []
    for it in range(2):
        result = ex.run(it, plan, mlp.data(it))
        losses.append(sum(result.losses) / 4)
        ex.stage.step()
    model, ref = reference.train(mlp.model, mlp.data, mlp.loss, mlp.optimizer, iterations=2, microbatches=4)
    assert losses == pytest.approx(ref, rel=1e-6)
    for i, layer in enumerate(model):
        for a, b in zip(ex.stage.layers[i].module.parameters(), layer.parameters()):
            torch.testing.assert_close(a, b)
    kinds = {k for k, *_ in result.spans}
    assert {"forward", "backward", "recompute", "swap_out", "swap_in"} <= kinds
    assert ("wgrad" in kinds) == (schedule == "zb-h1")  # the weight steps of a split backward, on their own spans
    for kind, mb, layer, start, end, _ in result.spans:
        if kind == "recompute":  # rebuilt inside its micro-batch's backward, between two of its pieces
            pieces = [(a, b) for k, m, _, a, b, _ in result.spans if k == "backward" and m == mb]
            assert layer is not None and any(b == start for _, b in pieces) and any(a == end for a, _ in pieces)


def test_budget_violation_names_kept_layers() -> None:
    ex, plan = executor("kkkkkkkkkk", "gpipe", budget=1)
    result = ex.run(0, plan, mlp.data(0))
    assert result.violation is not None and result.violation.stage == 0 and result.violation.layers


def test_default_loss() -> None:
    logits = torch.zeros(2, 5, 7)
    assert default_loss(logits, torch.zeros(2, 5, dtype=torch.long)).item() == pytest.approx(torch.log(torch.tensor(7.)).item())
    assert default_loss(torch.ones(3), torch.zeros(3)).item() == 1.0


def test_default_loss_reads_model_outputs() -> None:
    """A model output object: its own loss when there are no targets, else its logits."""

    class Out(dict):
        pass

    out = Out(logits=torch.zeros(2, 3, 7), loss=torch.tensor(1.5))
    assert default_loss(out, None).item() == 1.5
    assert default_loss(out, torch.zeros(2, 3, dtype=torch.long)).item() == pytest.approx(torch.log(torch.tensor(7.)).item())
    with pytest.raises(ValueError, match="no targets and the model's output has no loss"):
        default_loss(torch.zeros(2), None)


def test_a_torch_profiler_trace_reads_like_the_timeline() -> None:
    """Every action is a record_function range named like the timeline's spans."""
    ex, plan = executor("kkkkkrrrrr", "1f1b")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ex.run(0, plan, mlp.data(0))
    names = {e.name for e in prof.events()}
    for mb in range(4):
        assert f"vpipe/forward mb{mb}" in names and f"vpipe/backward mb{mb}" in names
    assert any(n.startswith("vpipe/recompute mb0 layer") for n in names)


def test_actions_are_not_labelled_while_no_profiler_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record_function per action costs ~3% of a small model's iteration when nobody listens."""
    entered: list[str] = []
    real = torch.profiler.record_function

    def spy(name: str) -> object:
        entered.append(name)
        return real(name)

    monkeypatch.setattr(torch.profiler, "record_function", spy)
    ex, plan = executor("kkkkkkkkkk", "1f1b")
    ex.run(0, plan, mlp.data(0))
    assert not any(n.startswith("vpipe/") for n in entered)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        ex.run(1, plan, mlp.data(1))
    assert "vpipe/forward mb0" in entered


def test_evaluate_is_forward_only_in_eval_mode() -> None:
    """The mean of the evaluation losses is plain eval-mode PyTorch's, and no parameter gets a gradient."""
    ex, plan = executor("kkkkkrrrrr", "1f1b")
    x, y = mlp.data(0)
    losses = ex.evaluate(plan, (x, y))
    torch.manual_seed(0)
    model = mlp.model().eval()
    with torch.no_grad():
        expected = [float(mlp.loss(model(xm), ym)) for xm, ym in zip(x.chunk(4), y.chunk(4))]
    assert losses == pytest.approx(expected, rel=1e-6)
    assert all(p.grad is None for _, p in ex.stage.params())
    assert all(ex.stage.layers[i].module.training for i in ex.stage.owned)
