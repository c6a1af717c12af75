"""Tensors the forward never touches stay part of the chain: each joins the unit it belongs to."""

from __future__ import annotations

import torch

from tests.integration import zoo
from vpipe_lab.runtime.build import on_meta
from vpipe_lab.runtime.model.capture import capture
from vpipe_lab.runtime.model.unused import adopt, home

MODULES = [["embed"], ["blocks.0"], ["blocks.1"], ["blocks.2", "head"]]
HELD = [["embed.weight", "embed.bias"], ["blocks.0.0.weight"], ["blocks.1.0.weight"], ["blocks.2.0.weight",
                                                                                       "head.weight"]]


def test_an_unused_tensor_goes_to_the_unit_that_ran_its_module() -> None:
    assert home("embed.mask_token", MODULES, HELD) == 0
    assert home("blocks.1.0.extra", MODULES, HELD) == 2


def test_a_module_that_never_ran_goes_with_its_closest_relatives_else_the_last_tie_else_the_first() -> None:
    modules = [["model.embed"], ["model.layers.0"], ["model.layers.1"], ["model.norm", "lm_head"]]
    held = [["model.embed.weight"], ["model.layers.0.w"], ["model.layers.1.w"], ["model.norm.weight"]]
    assert home("model.layers.1.unused.w", modules, held) == 2  # shares model.layers.1 with unit 2
    assert home("model.mtp_head.weight", modules, held) == 3  # only "model" in common with all: the output end
    assert home("pretrain_head.weight", modules, held) == 0  # nothing in common


def test_adopt_registers_at_the_dotted_path_inside_a_captured_unit() -> None:
    unit = torch.nn.Module()
    unit.graph = torch.nn.Module()
    p = torch.nn.Parameter(torch.ones(2))
    adopt(unit, "a.b.w", p)
    adopt(unit, "a.buf", torch.zeros(1))
    assert unit.graph.a.b.w is p and dict(unit.named_buffers())["graph.a.buf"].shape == (1,)


def test_a_captured_chain_holds_every_tensor_of_the_model_used_or_not() -> None:
    torch.manual_seed(0)
    model = zoo.with_unused()
    chain = capture(model.train(), torch.zeros(2, 6))
    held = {c: i for i, t in enumerate(chain.tensors) for _, c in t.params + t.buffers}
    assert set(held) == set(model.state_dict())
    assert held["embed.mask_token"] == 0  # with the embedding that owns it
    assert held["pretrain_head.weight"] == held["calls"] == 0  # nothing in common with any unit's: the first
    assert held["blocks.1.gate"] == 2  # in blocks.1's unit


def test_a_meta_layout_adopts_them_too_so_a_stage_builds_them() -> None:
    meta, _ = on_meta(zoo.with_unused, 0)
    chain = capture(meta.train(), torch.zeros(2, 6, device="meta"))
    held = {c for t in chain.tensors for _, c in t.params + t.buffers}
    assert "embed.mask_token" in held and "pretrain_head.bias" in held
