"""Bad input gets a clear error naming the stage and the cause, never a hang."""

from __future__ import annotations

import pytest
import torch

import vpipe_lab
from vpipe_lab.control.errors import WorkerError
from vpipe_lab.core.errors import PlanError
from vpipe_lab.examples import mlp

pytestmark = pytest.mark.slow


def not_sequential() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


def mismatched() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(5, 2))


def data4(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 4), torch.randn(8, 2)


def broken_data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError(f"no data for iteration {iteration}")


def test_more_stages_than_layers() -> None:
    with pytest.raises(WorkerError, match="the model has 10 layers but the pipeline has 11 stages"):
        vpipe_lab.launch("mlp", stages=11, microbatches=2, device="cpu", timeout=30, start_timeout=120)


def test_model_that_is_not_sequential() -> None:
    with pytest.raises(WorkerError, match=r"must be an nn\.Sequential"):
        vpipe_lab.launch(not_sequential, data4, stages=2, microbatches=2, device="cpu", timeout=30)


def test_data_function_that_raises() -> None:
    with vpipe_lab.launch(mlp.model, broken_data, stages=2, microbatches=2, device="cpu", timeout=30) as s:
        s.run(1)
        with pytest.raises(WorkerError) as err:
            s.wait(timeout=60)
    assert "no data for iteration 0" in str(err.value) and err.value.stage in (0, 1)


def test_shapes_that_do_not_match_between_stages() -> None:
    with vpipe_lab.launch(mismatched, data4, stages=2, microbatches=2, device="cpu", timeout=30) as s:
        s.run(1)
        with pytest.raises(WorkerError) as err:
            s.wait(timeout=60)
    assert err.value.stage == 1 and "shapes cannot be multiplied" in str(err.value)


def test_arguments_are_checked_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="stages must be"):
        vpipe_lab.launch("mlp", stages=0, microbatches=2)
    with pytest.raises(ValueError, match="unknown example 'resnet'"):
        vpipe_lab.launch("resnet", stages=2, microbatches=2)
    with pytest.raises(ValueError, match="no data"):
        vpipe_lab.launch(mlp.model, stages=2, microbatches=2)
    with pytest.raises(ValueError, match="memory_budget"):
        vpipe_lab.launch("mlp", stages=2, microbatches=2, memory_budget=[1])
    with pytest.raises(PlanError, match="pipeline has 2"):
        vpipe_lab.launch("mlp", stages=2, microbatches=2, plan=vpipe_lab.Plan.from_counts([3, 3, 4], 2))
