"""The fp16 loss scale: unscaling, overflow detection and the GradScaler-like schedule every stage follows."""

from __future__ import annotations

import pytest
import torch

from vpipe_lab.runtime.training.precision import LossScale, autocast, check


def test_unscale_divides_and_flags_overflow() -> None:
    scale = LossScale(True, init=4.0)
    grads = [torch.full((3,), 8.0), torch.tensor([4.0, float("inf")])]
    bad = scale.unscale(grads)
    assert bad is not None and float(bad) == 1.0
    assert torch.equal(grads[0], torch.full((3,), 2.0))
    assert float(scale.unscale([torch.ones(2)])) == 0.0  # type: ignore[arg-type]
    assert LossScale(False).unscale([torch.ones(1)]) is None


def test_the_scale_backs_off_on_overflow_and_grows_after_an_interval() -> None:
    scale = LossScale(True, init=8.0, interval=2)
    scale.update(True)
    assert scale.scale == 4.0
    scale.update(False)
    assert scale.scale == 4.0
    scale.update(False)
    assert scale.scale == 8.0
    restored = LossScale(True)
    restored.load(scale.state())
    assert restored.state() == scale.state()


def test_autocast_contexts() -> None:
    linear = torch.nn.Linear(2, 2)
    with autocast("bf16", torch.device("cpu"))():
        assert linear(torch.ones(1, 2)).dtype == torch.bfloat16
    with autocast("fp32", torch.device("cpu"))():
        assert linear(torch.ones(1, 2)).dtype == torch.float32
    with pytest.raises(ValueError, match="fp8"):
        check("fp8")
