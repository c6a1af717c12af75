"""Sharded stages (``shards=2``: each stage's parameters, gradients and optimizer state split over two ranks by torch's
FSDP2; 2 stages x 2 shards = 4 processes) against one process over the global batch with shards x M micro-batches.

Few and small: this machine has two cores. The cases cover the schedule x sharding x policy matrix pairwise (every
schedule meets every sharding choice, keep, recompute and swap on sharded units in each), with AdamW, global-norm
clipping over every stage and shard, and gpt-tiny's embedding tied to its LM head across the two stages."""

from __future__ import annotations

import pytest
import torch

import vpipe_lab
from tests.runtime import reference
from vpipe_lab import Plan
from vpipe_lab.examples import gpt, moe

pytestmark = pytest.mark.slow
POLICIES = ("keep", "recompute", "swap", "keep") * 2
# AdamW turns a near-zero gradient's last-bit differences (the shards' reduce-scatter adds the same terms in another
# order) into up to ~2e-5 of a parameter over a few steps; plain and pipelined runs differ so without shards too
# (tests/integration/test_models.py). A wrong gradient moves a parameter by a good part of a step (lr 3e-3).
REORDERING_ATOL = 5e-5


@pytest.mark.parametrize(("schedule", "sharding"), [
    ("1f1b", ("stream", "scatter")),
    ("interleaved-1f1b", ("regather", "hold")),
    ("zb-h1", ("hold", "stream")),
])
def test_two_sharded_stages_equal_one_process(schedule: str, sharding: tuple[str, str]) -> None:
    """Losses, gradient norms and every parameter and buffer (whole, from ``state_dict``) equal plain training; the
    timeline shows the all-gathers and reduce-scatters; each rank holds about half of its stage's parameters."""
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    bounds = (0, 2, 4, 6, 8) if virtual == 2 else (0, 4, 8)
    plan = Plan(bounds, POLICIES, 2, schedule, virtual, shards=2, sharding=sharding)
    with vpipe_lab.launch("gpt-tiny", stages=2, shards=2, microbatches=2, plan=plan, clip_grad_norm=0.5,
                          schedule=schedule, virtual_stages=virtual, device="cpu", timeout=90) as session:
        assert session.plan.devices == 4 and session.plan.sharding_of(1).value == sharding[1]
        session.run(2)
        session.wait(timeout=180)
        frame = session.metrics.iterations
        kinds = {s.kind for s in session.metrics.timeline()}
        memory = session.metrics.memory
        state = session.state_dict()
    norms: list[float] = []
    model, losses = reference.train(gpt.model, gpt.data, gpt.loss, gpt.optimizer, iterations=2, microbatches=4,
                                    clip=0.5, norms=norms)
    assert list(frame["loss"]) == pytest.approx(losses, rel=1e-5)
    assert list(frame["grad_norm"]) == pytest.approx(norms, rel=1e-4)
    reference.assert_state_matches(state, model)
    assert {"all_gather", "reduce_scatter"} <= kinds
    whole = {name: t.numel() * 4 for name, t in state.items() if t.is_floating_point()}
    last = memory[memory["iteration"] == memory["iteration"].max()]
    assert len(last) == 4  # a row per rank: 2 stages x 2 shards
    # every rank holds its shard of its stage's parameters: the two shards of a stage together hold each sharded
    # tensor once (the tie, kept whole on each, twice), so no rank holds its whole stage
    assert last["params"].sum() < 1.1 * sum(whole.values()) + 2 * gpt.model()[0].tok.weight.numel() * 4


def test_a_mixture_of_experts_model_equals_one_process() -> None:
    """moe-tiny's expert layers (8 experts each, top-2) sharded on both stages: the same as one process, the tokens
    each expert received too."""
    with vpipe_lab.launch("moe-tiny", stages=2, shards=2, microbatches=2, device="cpu", timeout=120) as session:
        session.run(2)
        session.wait(timeout=240)
        frame = session.metrics.iterations
        experts = session.metrics.experts
        state = session.state_dict()
    model, losses = reference.train(moe.model, moe.data, moe.loss, moe.optimizer, iterations=2, microbatches=4)
    assert list(frame["loss"]) == pytest.approx(losses, rel=1e-5)
    reference.assert_state_matches(state, model, atol=REORDERING_ATOL)
    assert len(experts) > 0


def test_bf16_autocast_equals_one_process_under_the_same_autocast() -> None:
    """bf16 autocast with float32 master weights, sharded: one process under the same autocast, to bf16's
    precision; the parameters, their shards and the optimizer's state stay float32."""
    with vpipe_lab.launch("gpt-tiny", stages=2, shards=2, microbatches=2, precision="bf16", device="cpu",
                          timeout=120) as session:
        session.run(2)
        session.wait(timeout=240)
        frame = session.metrics.iterations
        state = session.state_dict()
    model, losses = reference.train(gpt.model, gpt.data, gpt.loss, gpt.optimizer, iterations=2, microbatches=4,
                                    precision=torch.bfloat16)
    assert list(frame["loss"]) == pytest.approx(losses, rel=2e-3)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    reference.assert_state_matches(state, model, atol=2e-3)


def test_live_changes_between_sharded_stages_and_a_resume_onto_another_mesh(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A boundary move (units re-sharded on their new stage), a policy flip, a sharding change and a micro-batch
    count change, each at the next iteration, equal to one process; then the DCP checkpoint of sharded state resumes
    onto 3 whole stages and trains on exactly as one process does."""
    plan = Plan((0, 4, 8), ("keep",) * 8, 2, "1f1b", shards=2)
    with vpipe_lab.launch("gpt-tiny", stages=2, shards=2, microbatches=2, plan=plan, device="cpu",
                          timeout=90) as session:
        session.run(2)
        session.wait(timeout=180)
        session.apply(session.plan.with_boundaries((0, 2, 8)).with_policies({0: "recompute", 5: "swap"}))
        session.run(1)
        session.wait(timeout=180)
        session.apply(session.plan.with_mesh(sharding=("stream", "scatter")).replace(microbatches=4))
        assert session.plan.describe().startswith("1f1b 2x2x1 stream/scatter M=4")
        session.run(1)
        session.wait(timeout=180)
        frame = session.metrics.iterations
        state = session.state_dict()
        session.save(tmp_path / "ckpt")
    counts = [4, 4, 4, 8]  # shards x micro-batches of each iteration
    model, losses = reference.train(gpt.model, gpt.data, gpt.loss, gpt.optimizer, iterations=4,
                                    microbatches=lambda it: counts[it])
    assert list(frame["loss"]) == pytest.approx(losses, rel=1e-5)
    reference.assert_state_matches(state, model, atol=REORDERING_ATOL)
    with vpipe_lab.launch("gpt-tiny", stages=3, microbatches=4, device="cpu", timeout=90,
                          resume=tmp_path / "ckpt") as again:
        back = again.state_dict()
        again.run(1)
        again.wait(timeout=180)
        after = again.metrics.iterations
        continued = again.state_dict()
    assert list(back) == list(state) and all(torch.equal(back[k], state[k]) for k in state)
    # one process from the checkpoint, read by DCP into a plain model and AdamW (no process group): the next
    # iteration's loss and every parameter as the 3-stage job's (the optimizer's state came through it too)
    plain = gpt.model()
    model, more = reference.train(None, gpt.data, gpt.loss, lambda params: _resumed(plain, tmp_path / "ckpt"),
                                  iterations=1, microbatches=4, start=4, model=plain)
    assert list(after["loss"]) == pytest.approx(more, rel=1e-5)
    reference.assert_state_matches(continued, model, atol=REORDERING_ATOL)


def _resumed(model: torch.nn.Module, path) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    """``model`` and an AdamW over it filled from the lab's DCP checkpoint at ``path``, as a user's script would."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from vpipe_lab.wire.checkpoint_format import resolve

    version = str(resolve(path))
    weights = model.state_dict()
    dcp.load(weights, checkpoint_id=version)
    model.load_state_dict(weights)
    optimizer = gpt.optimizer(model.parameters())
    for p in model.parameters():  # AdamW's state exists once it stepped: made here, then read over
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    state = get_optimizer_state_dict(model, optimizer, options=flat)
    dcp.load({"optimizer": state}, checkpoint_id=version)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=flat)
    return optimizer


def test_what_a_sharded_job_cannot_do_is_refused_in_one_line_before_anything_starts() -> None:
    one_line = r"^the inputs have batch size 32, which does not split evenly across 3 data-parallel ranks[^\n]*$"
    with pytest.raises(ValueError, match=one_line):
        vpipe_lab.launch("mlp", stages=2, shards=3, microbatches=2, device="cpu", timeout=30)
    with pytest.raises(ValueError, match="shards=2 reduce each stage's gradients over its shards once per step"):
        vpipe_lab.launch("mlp", stages=2, shards=2, schedule="pipedream", device="cpu", timeout=30)
    with pytest.raises(ValueError, match="shards"):
        vpipe_lab.launch("mlp", stages=2, shards=0, device="cpu", timeout=30)
