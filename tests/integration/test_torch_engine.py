"""``engine="torch"``: torch.distributed.pipelining's runtime trains the planned job with the lab around it. Losses
and every tensor equal plain PyTorch's, across a plan change (a reshard onto another schedule and split); the
session's metrics, memory, timeline and profile come from it; its checkpoints resume on the lab's engine and the lab's
on it; what it cannot run is refused before anything starts; a failure names its stage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vpipe_lab
from tests.integration import torch_jobs
from tests.runtime import reference
from vpipe_lab import Plan
from vpipe_lab.control.errors import WorkerError
from vpipe_lab.examples import mlp

pytestmark = pytest.mark.slow


def test_torch_trains_the_plan_and_a_plan_change_reshards_it_exactly() -> None:
    first = Plan((0, 4, 10), tuple("kkrkkkkkkk"), 4, "1f1b")
    second = Plan((0, 2, 6, 8, 10), tuple("kkkkkkkskk"), 4, "interleaved-1f1b", 2)  # another schedule and split
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, plan=first, device="cpu", timeout=60,
                          engine="torch") as session:
        session.run(3)
        session.wait(timeout=120)
        spans = session.metrics.timeline(1)
        memory = session.metrics.latest_memory()
        profile = session.profile()
        assert session.apply(second) == 3
        assert session.plan == second
        session.run(2)
        session.wait(timeout=120)
        losses = list(session.metrics.iterations["loss"])
        state = session.state_dict()
        chunks = {(s.stage, s.chunk) for s in session.metrics.timeline(1)}
    model, ref_losses = reference.train(mlp.model, mlp.data, mlp.loss, mlp.optimizer, iterations=5, microbatches=4)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    reference.assert_state_matches(state, model)
    # what the dashboard draws: every micro-batch's forward and backward on both stages, each stage's memory
    assert sorted((s.stage, s.kind) for s in spans if s.microbatch == 3) == [(0, "backward"), (0, "forward"),
                                                                             (1, "backward"), (1, "forward")]
    assert [m["stage"] for m in memory] == [0, 1] and all(m["activations"] > 0 and m["params"] > 0 for m in memory)
    assert chunks == {(0, 0), (0, 1), (1, 0), (1, 1)}  # after the reshard: two chunks on each rank
    assert len(profile.layers) == 10 and all(c.forward_s > 0 for c in profile.layers)  # its stage times, shared
    assert profile.layers[2].param_bytes == sum(p.numel() * 4 for p in mlp.model()[2].parameters())


def test_checkpoints_move_between_the_engines(tmp_path: Path) -> None:
    """The torch engine's checkpoint resumes on the lab's engine (another split), the lab's on the torch engine:
    the same training as one uninterrupted plain run."""
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60, engine="torch") as session:
        session.run(2)
        session.wait(timeout=120)
        torch_ckpt = session.save(tmp_path / "from-torch")
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60, resume=torch_ckpt,
                          plan=Plan((0, 6, 10), tuple("k" * 10), 4)) as session:
        assert session.iteration == 2
        session.run(2)
        session.wait(timeout=120)
        lab_ckpt = session.save(tmp_path / "from-lab")
        losses = list(session.metrics.iterations["loss"])
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60, resume=lab_ckpt,
                          engine="torch") as session:
        assert session.iteration == 4
        session.run(1)
        session.wait(timeout=120)
        losses += list(session.metrics.iterations["loss"])
        state = session.state_dict()
    model, ref_losses = reference.train(mlp.model, mlp.data, mlp.loss, mlp.optimizer, iterations=5, microbatches=4)
    assert losses == pytest.approx(ref_losses[2:], rel=1e-5)
    reference.assert_state_matches(state, model)


def test_a_traced_model_trains_on_the_torch_engine_as_in_the_lab() -> None:
    """GPT-2 (tied embedding and head on different ranks) traced by torch's pipeline(): both engines give plain
    PyTorch's losses."""
    kw = dict(stages=2, microbatches=4, loss=torch_jobs.gpt2_loss, optimizer=torch_jobs.gpt2_optimizer, device="cpu",
              timeout=90)
    with vpipe_lab.launch(torch_jobs.gpt2, torch_jobs.gpt2_data, engine="torch", **kw) as session:
        session.run(3)
        session.wait(timeout=180)
        losses = list(session.metrics.iterations["loss"])
        state = session.state_dict()
    plain, plain_losses = reference.train(torch_jobs.gpt2, torch_jobs.gpt2_data, torch_jobs.gpt2_loss,
                                          torch_jobs.gpt2_optimizer, iterations=3, microbatches=4)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


def test_sharded_stages_on_torchs_pipelining_with_fully_shard_equal_one_process_and_the_lab_engine(
        tmp_path: Path) -> None:
    """engine="torch" with shards=2 (4 ranks): torch's pipelining composed with fully_shard, as torchtitan does,
    trains exactly as one process over the global batch does, through a plan change (a reshard from the DCP
    checkpoint of the sharded state), and its checkpoint resumes on the lab's engine, equal to it."""
    with vpipe_lab.launch("mlp", stages=2, shards=2, microbatches=2, engine="torch", device="cpu",
                          timeout=90) as session:
        session.run(2)
        session.wait(timeout=180)
        session.apply(session.plan.with_boundaries((0, 3, 10)))
        assert session.plan.shards == 2 and session.plan.boundaries == (0, 3, 10)
        session.run(1)
        session.wait(timeout=180)
        losses, state = list(session.metrics.iterations["loss"]), session.state_dict()
        version = session.save(tmp_path / "ckpt")
    model, ref_losses = reference.train(mlp.model, mlp.data, mlp.loss, mlp.optimizer, iterations=3, microbatches=4)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    reference.assert_state_matches(state, model)
    with vpipe_lab.launch("mlp", stages=2, shards=2, microbatches=2, device="cpu", timeout=90,
                          resume=version) as lab:
        back = lab.state_dict()
        lab.run(1)
        lab.wait(timeout=180)
        more = list(lab.metrics.iterations["loss"])
    assert all(torch.equal(back[k], state[k]) for k in state)
    _, four = reference.train(mlp.model, mlp.data, mlp.loss, mlp.optimizer, iterations=4, microbatches=4)
    assert more == pytest.approx(four[3:], rel=1e-5)


def test_what_the_torch_engine_cannot_run_is_refused_before_it_starts() -> None:
    with pytest.raises(ValueError, match="precision='bf16' needs engine='lab'"):
        vpipe_lab.launch("mlp", stages=2, microbatches=4, precision="bf16", engine="torch")
    with pytest.raises(ValueError, match="unknown engine 'jax'"):
        vpipe_lab.launch("mlp", stages=2, microbatches=4, engine="jax")


def failing_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if torch.equal(target, mlp.data(1)[1].chunk(4)[2]):  # iteration 1's micro-batch 2
        raise RuntimeError("the loss refuses this micro-batch")
    return mlp.loss(output, target)


def test_a_failure_on_the_torch_engine_names_its_stage_iteration_and_micro_batch() -> None:
    session = vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=60, engine="torch",
                               loss=failing_loss)
    try:
        session.run(5)
        with pytest.raises(WorkerError) as err:
            session.wait(timeout=120)
        assert err.value.stage == 1 and "the loss refuses this micro-batch" in str(err.value)
        assert str(err.value).startswith("stage 1 failed at iteration 1, micro-batch 2 (the loss of torch's stage 1)")
    finally:
        session.stop()
