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


def test_cuts_fall_between_the_outermost_blocks() -> None:
    """MobileNetV3 repeats Conv2dNormActivation inside its InvertedResidual blocks more often than the blocks
    themselves: the cut is between the blocks. GoogLeNet's Inception blocks sit on the model itself; T5's two stacks
    give way to the blocks they hold; a GPT-2 block's projections are never blocks."""
    import torchvision
    import transformers

    assert repeated_blocks(torchvision.models.mobilenet_v3_small()) == [f"features.{i}" for i in range(1, 12)]
    assert repeated_blocks(torchvision.models.googlenet(init_weights=False))[:2] == ["inception3a", "inception3b"]
    assert repeated_blocks(torchvision.models.vgg11())[:2] == ["features.0", "features.3"]  # convolutions, not ReLUs
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(num_layers=2, d_model=32, d_ff=64, num_heads=2,
                                                                       d_kv=16))
    assert repeated_blocks(t5) == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2))
    assert repeated_blocks(gpt2) == ["transformer.h.0", "transformer.h.1"]


def test_a_module_called_again_and_again_is_cut_between_its_calls() -> None:
    """ALBERT applies one layer group at every depth: no block repeats, one module's calls do; each call is a
    unit (the shared weights are then a tie across the stages that hold those units)."""
    from tests.models import zoo as models

    model = models.albert().train()
    inputs, _ = models.lm_data(0)
    chain = capture(model, {k: v[:4] for k, v in inputs.items()})
    group = "albert.encoder.albert_layer_groups.0"
    assert chain.names[1:5] == [group, f"{group}@1", f"{group}@2", f"{group}@3"]
    shared = {c for _, c in chain.tensors[1].params}
    assert shared and all({c for _, c in chain.tensors[i].params} == shared for i in range(2, 5))
    assert capture(model, {k: v[:4] for k, v in inputs.items()}, split=[f"{group}@2"]).names[1] == f"{group}@2"
