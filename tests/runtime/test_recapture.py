"""Captures for new shapes: made once per shape, on the meta device, running over the stage's own tensors."""

from __future__ import annotations

import pytest
import torch

from tests.integration import zoo
from vpipe_lab.runtime.build import bind
from vpipe_lab.runtime.model.batches import describe
from vpipe_lab.runtime.model.capture import CaptureError, capture
from vpipe_lab.runtime.recapture import Recaptures, meta_model


def run(chain, x):  # type: ignore[no-untyped-def]
    carry = chain.start(x)
    for unit in chain.units:
        carry = unit(carry)
    return chain.finish(carry)


def test_a_specialised_graph_is_captured_again_once_per_shape_and_runs_on_the_same_tensors() -> None:
    torch.manual_seed(0)
    model = zoo.length_switch().train()
    chain = capture(model, torch.zeros(2, 16, dtype=torch.long))  # branches on the length: specialised to > 12
    captures = Recaptures(zoo.length_switch, None, 0)
    short = torch.randint(0, zoo.VOCAB, (2, 12))
    assert captures.chain_for(chain, [describe(torch.zeros(2, 16, dtype=torch.long))[0]]) is None  # it fits
    other = captures.chain_for(chain, [describe(short)[0]])
    assert other is not None and captures.captures == 1 and other.names == chain.names
    assert captures.chain_for(chain, [describe(short)[0]]) is other and captures.captures == 1  # kept
    tensors = {name: t for unit, ts in zip(chain.units, chain.tensors) for local, name in ts.params + ts.buffers
               for t in [unit.get_parameter(local) if local in dict(unit.named_parameters()) else unit.get_buffer(local)]}
    for i, unit in enumerate(other.units):
        bind(unit, other, i, tensors)
    assert other.units[0].get_parameter("graph.embed.weight") is model.embed.weight  # the same tensor objects
    torch.testing.assert_close(run(other, short), model(short), rtol=0, atol=0)  # the other branch, computed


def test_micro_batches_that_no_one_graph_takes_are_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph captured for fixed shapes (as a model whose code fixes its batch size would be) cannot run the 2, 2,
    1, 1 samples of a short batch's micro-batches."""
    monkeypatch.setenv("VPIPE_LAB_CAPTURE", "static")
    chain = capture(zoo.two_input_net(), {"features": torch.zeros(2, 6), "mask": torch.ones(2)})
    captures = Recaptures(zoo.two_input_net, None, 0)
    parts = [describe({"features": torch.zeros(n, 6), "mask": torch.ones(n)})[0] for n in (2, 1)]
    assert captures.chain_for(chain, parts[:1]) is None
    with pytest.raises(CaptureError, match="micro-batches of different sizes cannot share one"):
        captures.chain_for(chain, parts[::-1])


def test_a_model_given_as_an_instance_has_a_meta_copy() -> None:
    model = zoo.length_switch()
    meta = meta_model(model, 0)
    assert meta is not model and all(p.is_meta for p in meta.parameters())
    assert not any(p.is_meta for p in model.parameters())


def test_a_gpt2_captured_again_on_the_meta_device_runs_on_the_stage_s_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's graph makes tensors (positions, masks) with the capture's device in their arguments: captured on the
    meta device, a unit runs once the stage points them at its own device."""
    from vpipe_lab.runtime.engine.stage import Stage

    monkeypatch.setenv("VPIPE_LAB_CAPTURE", "static")  # fixed shapes: another length needs a capture of its own
    torch.manual_seed(0)
    model = zoo.gpt2().eval()
    inputs = {"input_ids": torch.zeros(2, 16, dtype=torch.long), "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    chain = capture(model, inputs)
    short = {"input_ids": torch.randint(0, zoo.VOCAB, (2, 12)), "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    other = Recaptures(zoo.gpt2, None, 0).chain_for(chain, [describe(short)[0]])
    assert other is not None
    tensors = {name: t for t in list(model.parameters()) + list(model.buffers())
               for name in [next(n for n, x in list(model.named_parameters()) + list(model.named_buffers()) if x is t)]}
    stage = Stage(torch.device("cpu"), None, 0)
    for i, unit in enumerate(other.units):
        bind(unit, other, i, tensors)
        stage.add_layer(i, unit, other.tensors[i])  # points the graph's device arguments at the stage's
    with torch.no_grad():
        torch.testing.assert_close(run(other, short).logits, model(**short).logits, rtol=0, atol=0)
