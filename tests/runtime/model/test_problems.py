"""What stops torch.export is named, with the fix (runtime/model/trace/problems.py); a failure no fixed shape can mend is
not traced twice."""

from __future__ import annotations

import pytest
import torch

from vpipe_lab.runtime.model.capture import CaptureError, capture
from vpipe_lab.runtime.model.trace.problems import shape_independent


class Cache:
    """Stands for a generation-time cache object: not a tensor container torch.export knows."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class ReturnsAnObject(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Cache]:
        for block in self.blocks:
            x = block(x)
        return x, Cache(x)


class BranchesOnValues(ReturnsAnObject):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for block in self.blocks:
            x = block(x) if x.sum() > 0 else -block(x)
        return x


class Fails(ReturnsAnObject):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.blocks[0](x).view(3, -1, 7)  # a shape error in the model's own code


def test_an_output_object_is_named_with_the_fix() -> None:
    with pytest.raises(CaptureError, match=r"its forward returns a Cache object.*use_cache=False"):
        capture(ReturnsAnObject(), torch.zeros(2, 4))


def test_data_dependent_control_flow_is_named_with_the_fix() -> None:
    with pytest.raises(CaptureError, match=r"depends on a tensor's value.*torch.cond"):
        capture(BranchesOnValues(), torch.zeros(2, 4))


def test_any_other_failure_names_the_line_of_the_model_that_stopped_it() -> None:
    with pytest.raises(CaptureError, match=r"test_problems.py:\d+ in forward: return self.blocks\[0\]") as err:
        capture(Fails(), torch.zeros(2, 4))
    assert "control flow" not in str(err.value)  # not blamed on what did not happen


def test_a_failure_fixed_shapes_cannot_mend_is_traced_once_and_one_they_can_twice(monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    """A branch on values fails at any shapes: no second whole trace for fixed shapes (Gemma-3n's lifted constant took
    two failing traces of 7 s each before its layers ran eagerly). A shape error may be the free dimensions' doing:
    the capture for fixed shapes is still tried."""
    calls: list[bool] = []
    real = torch.export.export

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("dynamic_shapes") is not None)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.export, "export", counted)
    with pytest.raises(CaptureError):
        capture(BranchesOnValues(), torch.zeros(2, 4))
    assert calls == [True]
    calls.clear()
    with pytest.raises(CaptureError):
        capture(Fails(), torch.zeros(2, 4))
    assert calls == [True, False]


def test_shape_independent_failures_are_told_by_their_cause() -> None:
    try:
        raise RuntimeError("export failed") from ValueError("We found a fake tensor in the exported program constant's "
                                                            "list. This typically means ...")
    except RuntimeError as exc:
        assert shape_independent(exc)
    assert not shape_independent(RuntimeError("Constraints violated (L['x'].size()[0])"))
