"""Building only a stage's own tensors gives them exactly the values a plain seeded build gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.integration import zoo
from tests.runtime.model.test_capture import run_chain
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


def test_rank_0_builds_its_stage_on_the_cut_it_made_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 cuts the model alone first (``unit_names``, when many ranks start or the batch is shared): the stage it
    builds next is laid out on that cut, not captured again; the cut is taken once, and its stage computes as a
    stage captured afresh does."""
    import types

    from vpipe_lab.core.settings import Settings
    from vpipe_lab.runtime.model.batches import split
    from vpipe_lab.wire.jobspec import JobSpec

    spec = JobSpec("s", "k", "tcp://x:1", "127.0.0.1", 1, Settings(stages=1, microbatches=2))
    peer: Any = types.SimpleNamespace(device=torch.device("cpu"))
    inputs, _ = zoo.gpt2_data(0)

    def first() -> Any:
        return split(inputs, 2, "inputs")[0]

    names = build.unit_names(zoo.gpt2, None, 0, first)
    meta, order = build.on_meta(zoo.gpt2, 0)
    example = build._SCOUTED[0].example
    assert build._SCOUTED[0].serves(meta, order, example, torch.device("cpu"))
    assert not build._SCOUTED[0].serves(meta, order, example, torch.device("cuda"))  # traced as on the CPU only
    assert not build._SCOUTED[0].serves(meta, order, None, None)  # other inputs
    captures: list[int] = []
    real = build.capture
    monkeypatch.setattr(build, "capture", lambda *a, **k: captures.append(1) or real(*a, **k))
    scouted, _ = build.build_chain(spec, zoo.gpt2, None, 0, 1, peer, first)
    assert captures == [] and scouted.names == names
    fresh, _ = build.build_chain(spec, zoo.gpt2, None, 0, 1, peer, first)
    assert captures == [1] and fresh.signature() == scouted.signature()
    x = first()
    torch.testing.assert_close(run_chain(scouted, x), run_chain(fresh, x), rtol=0, atol=0)
