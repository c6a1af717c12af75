"""Where models are cut: at their repeated blocks, or where the user says."""

from __future__ import annotations

import pytest

from tests.integration import zoo
from vpipe_lab.runtime.model.batches import split
from vpipe_lab.runtime.model.capture import CaptureError, capture
from vpipe_lab.runtime.model.cuts import repeated_blocks


def test_resnet_blocks_and_split_choices() -> None:
    model = zoo.resnet18()
    assert repeated_blocks(model) == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    x = split(zoo.image_data(0)[0], 4, "inputs")[0]
    chain = capture(model, x, split=["layer2", "layer4"])
    assert chain.names == ["conv1+bn1+relu+…", "layer2+layer3", "layer4", "avgpool+fc"]
    chain = capture(model, x, split=lambda name, module: name in ("layer3", "fc"))
    assert chain.names == ["conv1+bn1+relu+…", "layer3+layer4+avgpool", "fc"]
    with pytest.raises(CaptureError, match="split point 'layer5' is not a submodule of ResNet; did you mean"):
        capture(model, x, split=["layer5"])
    with pytest.raises(CaptureError, match="chose no module"):
        capture(model, x, split=lambda name, module: False)
