"""Checkpoints in torch.distributed.checkpoint (DCP): what the lab saves, plain torch loads (``dcp.load`` into a
plain model and its optimizer, no process group) and trains on exactly as the lab does; what plain torch saves in
DCP, the lab resumes onto its pipeline; and the lab resumes its own checkpoints onto another partition, stage count
and schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import vpipe_lab
from tests.runtime import reference
from vpipe_lab import Plan
from vpipe_lab.examples import gpt, mlp

pytestmark = pytest.mark.slow
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # the layout torchtitan saves optimizers in


def plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, it: int, microbatches: int = 4) -> float:
    """One iteration of plain PyTorch gradient accumulation, as the lab's reference trains."""
    x, y = mlp.data(it)
    total = 0.0
    for xm, ym in zip(torch.chunk(x, microbatches), torch.chunk(y, microbatches)):
        loss = mlp.loss(model(xm), ym)
        (loss / microbatches).backward()
        total += float(loss.detach()) / microbatches
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def test_a_lab_checkpoint_loads_into_plain_torch_and_trains_on_as_the_lab_does(tmp_path: Path) -> None:
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60,
                          plan=Plan((0, 3, 10), tuple("k" * 10), 4)) as session:
        session.run(3)
        session.wait(timeout=120)
        version = session.save(tmp_path / "ckpt")
        session.run(2)
        session.wait(timeout=120)
        lab_losses = list(session.metrics.iterations["loss"])[3:]
        lab_state = session.state_dict()
    assert version.parent == tmp_path / "ckpt" and (version / ".metadata").exists()
    torch.manual_seed(99)  # other initial values: everything must come from the checkpoint
    model = mlp.model()
    optimizer = mlp.optimizer(model.parameters())
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(version))  # a plain process: no process group; it fills the model in place
    saved = {k: v.clone() for k, v in state.items()}
    plain_step(model, optimizer, 0)  # SGD's momentum buffers exist only once it stepped: then load them over it
    model.load_state_dict(saved)
    opt_state = get_optimizer_state_dict(model, optimizer, options=FLAT)
    dcp.load({"optimizer": opt_state}, checkpoint_id=str(version))
    set_optimizer_state_dict(model, optimizer, optim_state_dict=opt_state, options=FLAT)
    losses = [plain_step(model, optimizer, it) for it in (3, 4)]
    assert losses == pytest.approx(lab_losses, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(lab_state[key], value, msg=lambda m, key=key: f"{key}: {m}")


def test_a_checkpoint_torch_wrote_resumes_in_the_lab(tmp_path: Path) -> None:
    """Plain torch trains the MLP two iterations and saves model and optimizer with DCP, as torchtitan lays them
    out; the lab resumes that directory on a 2-stage pipeline and trains on equal to plain torch going on."""
    torch.manual_seed(0)
    model = mlp.model()
    optimizer = mlp.optimizer(model.parameters())
    for it in range(2):
        plain_step(model, optimizer, it)
    dcp.save({**model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer, options=FLAT)},
             checkpoint_id=str(tmp_path / "torch-ckpt"))
    expected = [plain_step(model, optimizer, it) for it in (0, 1)]  # the lab counts from 0 again: the same batches
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60,
                          resume=tmp_path / "torch-ckpt") as session:
        assert session.iteration == 0
        session.run(2)
        session.wait(timeout=120)
        losses = list(session.metrics.iterations["loss"])
        state = session.state_dict()
    assert losses == pytest.approx(expected, rel=1e-5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")


def test_a_checkpoint_resumes_onto_another_stage_count_and_schedule(tmp_path: Path) -> None:
    """Saved by 2 stages under 1F1B, resumed by 4 under interleaved 1F1B (another partition, every unit elsewhere):
    the same training as one uninterrupted plain run (gpt-tiny, with dropout: the lab seeds it per layer)."""
    with vpipe_lab.launch("gpt-tiny", stages=2, microbatches=4, device="cpu", timeout=60) as session:
        session.run(2)
        session.wait(timeout=120)
        path = session.save(tmp_path / "ckpt")
    # an export from the checkpoint keeps the micro-batch size the job ran with (it wrote null: torchtitan would split
    # the batch into micro-batches of 1)
    from vpipe_lab.cli.main import main
    from vpipe_lab.wire import bundle_files as bundle

    assert main(["export", str(tmp_path / "bundle"), "--checkpoint", str(path.parent)]) == 0
    assert bundle.read(tmp_path / "bundle").microbatch_size == gpt.BATCH // 4
    with vpipe_lab.launch("gpt-tiny", stages=4, microbatches=4, schedule="interleaved-1f1b", virtual_stages=2,
                          device="cpu", timeout=90, resume=path.parent) as session:
        assert session.iteration == 2 and session.plan.chunks == 8
        session.run(2)
        session.wait(timeout=180)
        losses = list(session.metrics.iterations["loss"])
        state = session.state_dict()
    model, ref_losses = reference.train(gpt.model, gpt.data, gpt.loss, gpt.optimizer, iterations=4, microbatches=4)
    assert losses == pytest.approx(ref_losses[2:], rel=1e-5)
    # four AdamW steps: the same sums in another order move a bias by ~1e-5 (tests/integration/test_models.py)
    reference.assert_state_matches(state, model, atol=5e-5)
