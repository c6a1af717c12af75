"""The trained model back out, as the model's own state_dict and in its library's form."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.integration import zoo
from vpipe_lab.control.weights import assemble, build, export
from vpipe_lab.wire.codec import decode
from vpipe_lab.wire.events import Tensors
from vpipe_lab.wire.tensors import encode


def answer(tensors: dict[str, tuple[torch.Tensor, list[list]]]) -> Tensors:  # type: ignore[type-arg]
    """A stage's STATE answer as it arrives: encoded, sent and decoded."""
    meta, buffers = [], []
    for key, (t, aliases) in tensors.items():
        m, b = encode(key, t)
        m.aliases = [(a, int(i)) for a, i in aliases]
        meta.append(m)
        buffers.append(b)
    body = decode(Tensors(1, 0, meta, buffers).message())
    assert isinstance(body, Tensors)
    return body


def test_stages_answers_become_the_model_s_own_state_dict() -> None:
    model = zoo.tied_sequential()
    keys = list(model.state_dict())
    place = {k: i for i, k in enumerate(keys)}
    first = answer({"0.weight": (model[0].weight.detach(), [["0.weight", place["0.weight"]],
                                                            ["5.weight", place["5.weight"]]]),
                    "1.weight": (model[1].weight.detach(), [["1.weight", place["1.weight"]]])})
    rest = {k: (v, [[k, place[k]]]) for k, v in model.state_dict().items() if k not in ("0.weight", "5.weight",
                                                                                          "1.weight")}
    state = assemble([answer(rest), first])
    assert list(state) == keys and state["5.weight"] is state["0.weight"]
    fresh = zoo.tied_sequential()
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_export_writes_a_state_dict_file_for_a_plain_model(tmp_path: Path) -> None:
    model = zoo.tied_sequential()
    written = export(model.state_dict(), zoo.tied_sequential, tmp_path / "out")
    assert written == tmp_path / "out" / "model.pt"
    again = zoo.tied_sequential()
    again.load_state_dict(torch.load(written), strict=True)
    assert torch.equal(again[3].weight, model[3].weight)
    copy = build(model)
    assert copy is not model and torch.equal(copy[1].weight, model[1].weight)
