"""Building only a stage's own tensors gives them exactly the values a plain seeded build gives."""

from __future__ import annotations

import pytest
import torch

from tests.integration import zoo
from vpipe_lab.runtime import build
from vpipe_lab.runtime.model.capture import canonical_names


def storages(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters and buffers."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize(("factory", "owned"), [
    (zoo.gpt2, ("transformer.h.1.", "transformer.wte.weight")),       # a block, and the tied embedding/head
    (zoo.resnet18, ("layer3.", "fc.")),                               # conv/bn weights and running statistics
    (zoo.tied_sequential, ("3.",)),
])
def test_owned_tensors_get_the_plain_values_and_the_rest_shares_scratch(factory, owned) -> None:
    torch.manual_seed(3)
    plain = factory()
    expected = {name: t for name, t in {**dict(plain.named_parameters()), **dict(plain.named_buffers())}.items()}
    meta, order = build.on_meta(factory, 3)
    assert all(p.is_meta for p in meta.parameters())
    names = build.registered_names(meta, order)
    keep = {n for n in expected if n.startswith(owned)}
    assert keep
    model = build.owned_only(factory, 3, names, keep)
    got = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert set(got) == set(expected)
    for name in keep:
        assert torch.equal(got[name], expected[name]), name
    own_bytes = sum(expected[n].numel() * expected[n].element_size() for n in keep)
    largest = max(t.numel() * t.element_size() for t in expected.values())
    assert storages(model) <= own_bytes + 2 * largest  # the rest lives in reused scratch memory
    assert storages(model) < storages(plain)
    assert set(canonical_names(model).values()) == set(canonical_names(plain).values())  # ties stay ties


def test_a_factory_that_builds_differently_is_refused() -> None:
    calls = []

    def fickle() -> torch.nn.Module:
        calls.append(1)
        return torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(len(calls))])

    meta, order = build.on_meta(fickle, 0)
    with pytest.raises(RuntimeError, match="does not build the same model every time"):
        build.owned_only(fickle, 0, build.registered_names(meta, order), set())
