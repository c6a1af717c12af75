"""A NaN or infinite loss: paused before the step with nothing changed (the default), the step skipped on every stage,
or trained on; each against one process doing the same by hand (tests/runtime/reference.py)."""

from __future__ import annotations

import math

import pytest
import torch

import vpipe_lab
from tests.runtime import reference
from vpipe_lab.examples import mlp
from vpipe_lab.runtime.iteration_end import first_nonfinite

BAD_ITERATION, BAD_MICROBATCH = 3, 1  # mlp's batch of 32 in 4 micro-batches of 8


def poisoned(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mlp's data with NaN inputs in micro-batch 1 of iteration 3 (a corrupt sample, as real data has)."""
    x, y = mlp.data(iteration)
    if iteration == BAD_ITERATION:
        x = x.clone()
        x[8 * BAD_MICROBATCH:8 * (BAD_MICROBATCH + 1)] = float("nan")
    return x, y


def test_the_first_nonfinite_loss_is_named() -> None:
    assert first_nonfinite([0.5, 1.0]) == (-1, "")
    assert first_nonfinite([0.5, float("inf"), float("nan")]) == (1, "inf")
    assert first_nonfinite([float("nan")]) == (0, "nan")


@pytest.mark.slow
def test_a_nan_loss_pauses_before_the_step_with_nothing_changed_and_names_where() -> None:
    with vpipe_lab.launch("mlp", poisoned, stages=2, microbatches=4, device="cpu", timeout=60) as session:
        session.run(6)
        with pytest.raises(vpipe_lab.NonFiniteLoss) as caught:
            session.wait(timeout=60)
        err = caught.value
        assert (err.iteration, err.microbatch, err.stage, err.value) == (BAD_ITERATION, BAD_MICROBATCH, 1, "nan")
        assert "iteration 3, micro-batch 1 is nan" in str(err) and "nothing changed" in str(err)
        assert session.iteration == BAD_ITERATION and session.status == "paused"
        state = session.state_dict()
        session.resume()  # the same batch again: the same verdict, still nothing changed
        with pytest.raises(vpipe_lab.NonFiniteLoss, match="iteration 3, micro-batch 1"):
            session.wait(timeout=60)
        assert session.iteration == BAD_ITERATION
        again = session.state_dict()
    model, _ = reference.train(mlp.model, poisoned, mlp.loss, mlp.optimizer, iterations=BAD_ITERATION, microbatches=4)
    reference.assert_state_matches(state, model)
    assert all(torch.equal(state[k], again[k]) for k in state)


@pytest.mark.slow
def test_skip_steps_over_the_iteration_on_every_stage_and_continue_trains_on_it() -> None:
    with vpipe_lab.launch("mlp", poisoned, stages=2, microbatches=4, device="cpu", timeout=60,
                          nonfinite="skip") as session:
        session.run(6)
        session.wait(timeout=90)
        rows = session.metrics.iterations.set_index("iteration")
        state = session.state_dict()
    assert math.isnan(rows.loss[BAD_ITERATION]) and bool(rows.skipped[BAD_ITERATION])
    assert not rows.skipped.drop(BAD_ITERATION).fillna(False).astype(bool).any()
    # one process that never stepped on iteration 3: the same as training on the other five batches
    kept = [i for i in range(6) if i != BAD_ITERATION]
    model, losses = reference.train(mlp.model, lambda i: poisoned(kept[i]), mlp.loss, mlp.optimizer, iterations=5,
                                    microbatches=4)
    reference.assert_state_matches(state, model)
    assert list(rows.loss.drop(BAD_ITERATION)) == pytest.approx(losses, rel=1e-5)
    with vpipe_lab.launch("mlp", poisoned, stages=2, microbatches=4, device="cpu", timeout=60,
                          nonfinite="continue") as session:
        session.run(5)
        session.wait(timeout=90)
        state = session.state_dict()
    assert all(torch.isnan(v).any() for k, v in state.items() if k.endswith("weight"))  # as plain PyTorch would


def test_an_unknown_choice_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"unknown nonfinite 'ignore': use one of pause, skip, continue"):
        vpipe_lab.launch("mlp", stages=2, microbatches=4, nonfinite="ignore")
