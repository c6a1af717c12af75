"""Pieces of running a bundle on torch, on one process: torch's split of a traced model and the values it passes past
a stage, the recompute and offload wrappers (same numbers, the user's parameter names), and the action letters."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import SplitPoint, pipeline

from tests.integration import torch_jobs
from vpipe_lab.core.interop.bundle import StageSpec
from vpipe_lab.runtime.torch_pp import pipeline as tp


def test_values_passed_past_a_stage_are_found() -> None:
    model = torch_jobs.gpt2().train()
    x, _ = torch_jobs.gpt2_data(0)
    two = pipeline(model, (x[:2],), split_spec={"transformer.h.2": SplitPoint.BEGINNING})
    assert tp.skips(two.split_gm) == []
    four = pipeline(torch_jobs.gpt2().train(), (x[:2],),
                    split_spec={f"transformer.h.{i}": SplitPoint.BEGINNING for i in (1, 2, 3)})
    assert tp.skips(four.split_gm) == ["stage 0 -> stage 2", "stage 0 -> stage 3"]  # the mask every block reads


def test_wrappers_keep_the_numbers_and_the_names() -> None:
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    wrapped = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    wrapped.load_state_dict(plain.state_dict())
    outer = torch.nn.Sequential(wrapped)
    tp.apply_policies(outer, StageSpec(0, 0, None, ("0",), recompute=("0.0", "0.1"), offload=("0.2",)),
                      torch.device("cpu"))
    x = torch.randn(3, 4)
    torch.manual_seed(1)
    plain(x).sum().backward()
    torch.manual_seed(1)
    outer(x).sum().backward()  # dropout replayed with the same mask when the recompute runs again
    for (name, p), (wname, q) in zip(plain.named_parameters(), outer.named_parameters()):
        assert tp.plain_name(wname) == f"0.{name}"
        torch.testing.assert_close(p.grad, q.grad)
    with pytest.raises(ValueError, match="no module 'nope'"):
        tp.apply_policies(outer, StageSpec(0, 0, None, ("0",), recompute=("nope",)), torch.device("cpu"))


def test_backward_letters_are_torchs() -> None:
    assert tp._backward_letter((0, None), {}) == "B"
    assert tp._backward_letter((0, None, False), {}) == "I"
    assert tp._backward_letter((0,), {"full_backward": False}) == "I"
    assert str(tp.Action(3, "W", 1, 0.0, 1.0)) == "3W1"
