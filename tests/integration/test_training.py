"""A real training job's parts on the pipeline, each against plain single-process PyTorch on the same global batch:
an LR schedule, global-norm clipping, mixed precision, evaluation and metrics logging."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import vpipe_lab
from tests.runtime import reference
from vpipe_lab import Plan
from vpipe_lab.examples import gpt, mlp

pytestmark = pytest.mark.slow


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def warmup(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def test_adamw_warmup_and_global_clipping_match_plain_pytorch_across_a_migration() -> None:
    """AdamW + warm-up LambdaLR + clip_grad_norm=0.5 on 2 stages; a live migration halfway moves layers with their
    parameter groups (the scheduler's lr) and optimizer state: the losses, the reported global norms and learning
    rates, and every parameter equal the single-process run's."""
    with vpipe_lab.launch(mlp.model, mlp.data, loss=mlp.loss, optimizer=adamw, lr_scheduler=warmup,
                          clip_grad_norm=0.5, stages=2, microbatches=4, device="cpu", timeout=60) as session:
        session.run(3)
        session.wait(timeout=120)
        session.apply(Plan((0, 7, 10), ("keep",) * 10, 4, "1f1b"))
        session.run(3)
        session.wait(timeout=120)
        frame = session.metrics.iterations
        state = session.state_dict()
    norms: list[float] = []
    model, losses = reference.train(mlp.model, mlp.data, mlp.loss, adamw, iterations=6, microbatches=4,
                                    scheduler_fn=warmup, clip=0.5, norms=norms)
    assert list(frame["loss"]) == pytest.approx(losses, rel=1e-5)
    assert list(frame["grad_norm"]) == pytest.approx(norms, rel=1e-4)
    assert max(norms) > 0.5  # clipping really happened
    assert list(frame["lr"]) == pytest.approx([3e-3 * min(1.0, (s + 1) / 3) for s in range(6)])
    reference.assert_state_matches(state, model)


def test_tied_gpt_with_clipping_counts_the_shared_weight_once() -> None:
    """gpt-tiny ties its embedding and LM head across stages: the global norm counts that weight once."""
    plan = Plan((0, 4, 8), ("keep",) * 8, 2, "1f1b")
    with vpipe_lab.launch("gpt-tiny", stages=2, microbatches=2, plan=plan, clip_grad_norm=0.1, device="cpu",
                          timeout=90) as session:
        session.run(2)
        session.wait(timeout=180)
        frame = session.metrics.iterations
        state = session.state_dict()
    norms: list[float] = []
    model, losses = reference.train(gpt.model, gpt.data, gpt.loss, gpt.optimizer, iterations=2, microbatches=2,
                                    clip=0.1, norms=norms)
    assert list(frame["loss"]) == pytest.approx(losses, rel=1e-5)
    assert list(frame["grad_norm"]) == pytest.approx(norms, rel=1e-4)
    reference.assert_state_matches(state, model)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32_with_float32_parameters(precision: str) -> None:
    """bf16/fp16 autocast: losses within a few percent of fp32 training, parameters still float32; fp16 reports
    its loss scale and skips no step on this well-scaled model."""
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, precision=precision, device="cpu",
                          timeout=60) as session:
        session.run(3)  # half-precision GEMMs are emulated on CPUs without AVX-512 BF16/FP16: each step is slow
        session.wait(timeout=120)
        frame = session.metrics.iterations
        state = session.state_dict()
    _, fp32 = reference.train(mlp.model, mlp.data, mlp.loss, mlp.optimizer, iterations=3, microbatches=4)
    assert list(frame["loss"]) == pytest.approx(fp32, rel=0.05)
    assert list(frame["loss"]) != pytest.approx(fp32, rel=1e-6)  # the compute really ran in half precision
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    if precision == "fp16":
        assert list(frame["loss_scale"]) == [2.0 ** 16] * 3
        assert not frame["skipped"].any()


def test_fp16_overflow_skips_the_same_step_on_every_stage() -> None:
    """A loss scale so large that the gradients overflow: every stage skips the step (no parameter moves), the scale
    halves, and training then proceeds with the same parameters on all stages as the reference's skipped steps."""
    def huge(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = mlp.data(iteration)
        return x * 3e4, y  # fp16 activations overflow at 65504

    # nonfinite="continue": the forward's overflow makes the loss NaN too, which by default pauses the job
    # (tests/runtime/test_iteration_end.py); here the fp16 gradients' own check is what skips the step
    with vpipe_lab.launch(mlp.model, huge, loss=mlp.loss, optimizer=mlp.optimizer, stages=2, microbatches=4,
                          precision="fp16", device="cpu", timeout=60, nonfinite="continue") as session:
        before = session.state_dict()
        session.run(2)
        session.wait(timeout=120)
        frame = session.metrics.iterations
        after = session.state_dict()
    assert frame["skipped"].all()
    assert list(frame["loss_scale"]) == [2.0 ** 16, 2.0 ** 15]
    for key, value in before.items():
        assert torch.equal(value, after[key]), key


@pytest.mark.parametrize(("virtual", "schedule"), [(1, "1f1b"), (2, "interleaved-1f1b"), (2, "zbv")])
def test_evaluate_is_forward_only_and_changes_nothing(virtual: int, schedule: str) -> None:
    """Session.evaluate: the mean loss of the model in eval mode (dropout off) over N batches, equal to plain
    PyTorch's; training afterwards is unchanged (same losses as a run without the evaluation). With two virtual
    stages per rank (interleaved 1F1B) each micro-batch crosses both ranks twice, a tag per chunk; under ZBV it
    turns on stage 1 without a transfer and stage 0, which holds the targets, computes the loss."""
    plan = Plan((0, 4, 8) if virtual == 1 else (0, 2, 4, 6, 8), ("keep",) * 8, 2, schedule, virtual)
    with vpipe_lab.launch("gpt-tiny", stages=2, microbatches=2, plan=plan, schedule=plan.schedule,
                          virtual_stages=virtual, device="cpu", timeout=90) as session:
        session.run(1)
        session.wait(timeout=120)
        value = session.evaluate(batches=2)
        session.run(1)
        session.wait(timeout=120)
        frame = session.metrics.iterations
        evaluations = session.metrics.evaluations
    model, _ = reference.train(gpt.model, gpt.data, gpt.loss, gpt.optimizer, iterations=1, microbatches=2)
    model.eval()
    with torch.no_grad():
        expected = []
        for b in range(2):
            x, y = gpt.data(b)
            expected.append(sum(float(gpt.loss(model(xm), ym)) for xm, ym in zip(x.chunk(2), y.chunk(2))) / 2)
    assert value == pytest.approx(sum(expected) / 2, rel=1e-5)
    _, both = reference.train(gpt.model, gpt.data, gpt.loss, gpt.optimizer, iterations=2, microbatches=2)
    assert list(frame["loss"]) == pytest.approx(both, rel=1e-5)
    assert list(evaluations["iteration"]) == [1] and evaluations["loss"][0] == pytest.approx(value)


def test_periodic_evaluation_and_logging_to_tensorboard_and_a_function(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    with vpipe_lab.launch("mlp", stages=2, microbatches=2, eval_data="mlp", eval_every=2, clip_grad_norm=1.0,
                          device="cpu", timeout=60, log=f"tensorboard:{tmp_path}") as session:
        session._logger.sink = _Both(session._logger.sink, seen.append)
        session.run(4)
        session.wait(timeout=120)
        deadline = time.monotonic() + 60  # the evaluation after iteration 4 reports just after that iteration
        while len(session.metrics.evaluations) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        evaluations = session.metrics.evaluations
    assert list(evaluations["iteration"]) == [2, 4]
    assert all(math.isfinite(v) for v in evaluations["loss"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("loss", "grad_norm", "lr", "samples_per_s", "stage0/time_s", "stage1/peak_bytes", "eval/loss"):
        assert tag in tags, tag
    assert [e.step for e in acc.Scalars("loss")] == [0, 1, 2, 3]
    scalars = [r for r in seen if r["type"] == "scalars" and "loss" in r]
    assert [r["step"] for r in scalars] == [0, 1, 2, 3]
    json.dumps(seen)  # plain data


class _Both:
    """The launched TensorBoard sink and a function, side by side."""

    def __init__(self, first: Any, fn: Any) -> None:
        from vpipe_lab.telemetry.sinks import Callback

        self.sinks = [first, Callback(fn)]

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for s in self.sinks:
            s.scalars(step, values)

    def event(self, step: int, name: str, text: str) -> None:
        for s in self.sinks:
            s.event(step, name, text)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def test_bad_training_options_are_refused_before_anything_starts() -> None:
    for kwargs, words in (({"clip_grad_norm": -1}, "clip_grad_norm"), ({"precision": "fp8"}, "fp8"),
                          ({"eval_every": 0}, "eval_every"), ({"log": "influx:x"}, "influx"),
                          ({"lr_scheduler": "mlp"}, "lr_scheduler")):
        with pytest.raises(ValueError, match=words):
            vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu", **kwargs)


def test_transformers_gpt2_with_schedule_clipping_and_evaluation() -> None:
    """A HuggingFace GPT-2 (captured with torch.export, tied embedding and LM head on different stages, dict inputs
    with an attention mask): AdamW + warm-up + global clipping match plain PyTorch, and evaluation runs its
    captured graph in eval mode."""
    from tests.integration import zoo

    plan = Plan((0, 3, 6), ("keep", "recompute", "keep", "keep", "swap", "keep"), 4, "1f1b")
    with vpipe_lab.launch(zoo.gpt2, zoo.gpt2_data, loss=zoo.lm_loss, optimizer=zoo.adamw, lr_scheduler=warmup,
                          clip_grad_norm=0.5, stages=2, microbatches=4, plan=plan, device="cpu", timeout=90,
                          start_timeout=180) as session:
        session.run(3)
        session.wait(timeout=240)
        value = session.evaluate(batches=1)
        frame = session.metrics.iterations
        state = session.state_dict()
    norms: list[float] = []
    model, losses = reference.train(zoo.gpt2, zoo.gpt2_data, zoo.lm_loss, zoo.adamw, iterations=3, microbatches=4,
                                    scheduler_fn=warmup, clip=0.5, norms=norms)
    assert list(frame["loss"]) == pytest.approx(losses, rel=1e-5)
    assert list(frame["grad_norm"]) == pytest.approx(norms, rel=1e-4) and max(norms) > 0.5
    reference.assert_state_matches(state, model)
    model.eval()
    x, y = zoo.gpt2_data(0)
    with torch.no_grad():
        parts = [zoo.lm_loss(model(**{k: v.chunk(4)[i] for k, v in x.items()}), y.chunk(4)[i])
                 for i in range(4)]
    assert value == pytest.approx(float(sum(parts)) / 4, rel=1e-5)
