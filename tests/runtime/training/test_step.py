"""The stage step: global-norm clipping equals torch.nn.utils.clip_grad_norm_ on one stage (world 1)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.training.place import Place
from vpipe_lab.runtime.training.precision import LossScale
from vpipe_lab.runtime.training.step import Stepper


def stage_and_copy() -> tuple[Stage, torch.nn.Sequential]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    copy = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    copy.load_state_dict(model.state_dict())
    stage = Stage(torch.device("cpu"), lambda ps: torch.optim.SGD(ps, lr=0.1), seed=0)
    for i, layer in enumerate(model):
        stage.add_layer(i, layer)
    return stage, copy


def no_ties() -> Any:
    return SimpleNamespace(shared=[], reduce_grads=lambda: None)


def test_clipping_matches_clip_grad_norm() -> None:
    stage, copy = stage_and_copy()
    x = torch.randn(8, 4) * 10
    for model in (torch.nn.Sequential(*(stage.layers[i].module for i in stage.owned)), copy):
        model(x).pow(2).sum().backward()
    stepper = Stepper(stage, no_ties(), None, Place(0, 1), 0.5, LossScale(False))  # type: ignore[arg-type]
    report = stepper.step(0)
    expected = torch.nn.utils.clip_grad_norm_(copy.parameters(), 0.5)
    torch.optim.SGD(copy.parameters(), lr=0.1).step()
    assert report.grad_norm == pytest.approx(float(expected), rel=1e-6) and report.grad_norm > 0.5
    assert report.lr == 0.1 and not report.skipped
    for (_, p), q in zip(stage.params(), copy.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())
        assert p.grad is None


def test_an_overflow_skips_the_step_and_halves_the_scale() -> None:
    stage, _ = stage_and_copy()
    before = [p.detach().clone() for _, p in stage.params()]
    for _, p in stage.params():
        p.grad = torch.full_like(p, float("nan"))
    scale = LossScale(True)
    report = Stepper(stage, no_ties(), None, Place(0, 1), None, scale).step(0)  # type: ignore[arg-type]
    assert report.skipped and scale.scale == 2.0 ** 15
    assert all(torch.equal(a, p) for a, (_, p) in zip(before, stage.params()))


def test_bad_clip_values_are_refused() -> None:
    stage, _ = stage_and_copy()
    with pytest.raises(ValueError, match="clip_grad_norm"):
        Stepper(stage, no_ties(), None, Place(0, 1), 0.0, LossScale(False))  # type: ignore[arg-type]


def test_under_pipedream_the_iteration_step_only_moves_the_schedule_and_refuses_a_global_norm() -> None:
    """PipeDream's stages stepped after every micro-batch: the iteration's step leaves the weights alone (reporting
    the learning rate used); clipping, which needs every stage's gradients at once, is refused where a torchrun job
    would otherwise have skipped it silently."""
    stage, _ = stage_and_copy()
    stage.stash.on = True
    before = [p.detach().clone() for _, p in stage.params()]
    report = Stepper(stage, no_ties(), None, Place(0, 1), None, LossScale(False)).step(0)  # type: ignore[arg-type]
    assert report.lr == 0.1 and report.grad_norm is None
    assert all(torch.equal(a, p) for a, (_, p) in zip(before, stage.params()))
    with pytest.raises(ValueError, match=r"clip_grad_norm=0\.5 clips by the whole model's gradient norm"):
        Stepper(stage, no_ties(), None, Place(0, 1), 0.5, LossScale(False)).step(0)  # type: ignore[arg-type]


def test_a_skipped_step_drops_the_gradients_and_moves_only_the_schedule() -> None:
    """nonfinite="skip": every rank agreed a loss was not finite; nothing of the model or the optimizer moves."""
    stage, _ = stage_and_copy()
    before = [p.detach().clone() for _, p in stage.params()]
    for _, p in stage.params():
        p.grad = torch.ones_like(p)  # finite gradients: the verdict is the loss's, not the gradients'
    report = Stepper(stage, no_ties(), None, Place(0, 1), 0.5, LossScale(False)).step(0, skip=True)  # type: ignore[arg-type]
    assert report.skipped and report.lr == 0.1 and report.grad_norm is None
    assert all(torch.equal(a, p) and p.grad is None for a, (_, p) in zip(before, stage.params()))
