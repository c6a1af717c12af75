"""The zoo's vision models (transformers' ViT, Swin, ConvNeXt; torchvision's families), each trained on 2 stages
with the default cut, equal to one process (batch norm statistics included)."""

from __future__ import annotations

import pytest

from tests.models.zoo import ZOO, check

pytestmark = [pytest.mark.slow, pytest.mark.models]
VISION = [n for n, e in ZOO.items() if e.family in ("convnet", "vision transformer")]


@pytest.mark.parametrize("name", VISION)
def test_vision_model_trains_as_one_process(name: str) -> None:
    names = check(name)
    assert len(names) >= 4
    if name == "mobilenet_v3_small":  # between the InvertedResidual blocks, never inside one
        assert names[1:12] == [f"features.{i}" for i in range(1, 12)]
