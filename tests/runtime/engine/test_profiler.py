import pytest
import torch

from vpipe_lab.core.plan import Policy
from vpipe_lab.core.profile import LayerCost
from vpipe_lab.runtime.engine.profiler import layer_costs
from vpipe_lab.runtime.engine.stage import Stage
from vpipe_lab.runtime.model.capture import UnitTensors


def test_layer_costs_are_measured_and_valid() -> None:
    stage = Stage(torch.device("cpu"), lambda p: torch.optim.Adam(p), seed=0)
    stage.add_layer(3, torch.nn.Linear(16, 32))
    stage.add_layer(4, torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.ReLU()))
    stage.set_policies({4: Policy.RECOMPUTE})
    stage.probing = True
    clock = iter(range(1000)).__next__
    for mb in range(2):
        h = torch.randn(5, 16)
        for segment in stage.segments(profile=True):
            h = stage.forward(mb, segment, h, timer=lambda: float(clock()))
        g = (torch.ones_like(h),)
        for segment in reversed(stage.segments(profile=True)):
            g = stage.backward(mb, segment, g, lambda: float(clock()))
    stage.step()
    docs = layer_costs(stage, {3: "encoder", 4: "head"})
    assert [d.index for d in docs] == [3, 4] and [d.cost.name for d in docs] == ["encoder", "head"]
    first = docs[0].cost
    assert isinstance(first, LayerCost) and type(docs[0]).from_dict(docs[0].to_dict()) == docs[0]  # off the wire too
    assert first.forward_s > 0 and first.backward_s > 0
    assert first.input_bytes == 5 * 16 * 4 and first.output_bytes == 5 * 32 * 4
    assert first.param_bytes == (16 * 32 + 32) * 4
    # Adam: exp_avg and exp_avg_sq per parameter, plus a 4-byte step counter per parameter tensor
    assert first.optimizer_bytes == 2 * first.param_bytes + 2 * 4
    assert first.activation_bytes == 5 * 16 * 4  # Linear saves its input
    assert docs[1].cost.activation_bytes > 0  # measured when the recomputed layer was rematerialised
    assert [t[0] for t in first.times] == [2, 10]  # probed at half and twice the micro-batch of 5
    assert all(f > 0 and b > 0 for _, f, b in first.times)


def test_profile_schedule_after_a_trigger_and_periodically() -> None:
    from vpipe_lab.runtime.engine.profiler import ProfileSchedule

    sched = ProfileSchedule(every=10, after_trigger=3)
    got = [sched.next(it) for it in range(1, 13)]
    # Start-up: three profiling iterations, the measurements of the first (cold) dropped when the second begins.
    assert got[:4] == [(True, False), (True, True), (True, False), (False, False)]
    assert got[9] == (True, False) and sum(p for p, _ in got[3:]) == 1  # iteration 10 only, then fused
    sched.soon()  # a plan change
    assert [sched.next(it) for it in (13, 14, 15, 16)] == [(True, False), (True, True), (True, False), (False, False)]

    with pytest.raises(ValueError, match="at least 2"):
        ProfileSchedule(after_trigger=1)


def test_the_pipeline_s_data_input_and_what_the_loss_saves_are_measured() -> None:
    """The first layer's input is the batch's data (no gradient): its bytes are what stage 0 holds per micro-batch
    (the cost model counts the whole batch from them); what the loss saves for its backward (cross-entropy: the
    log-probabilities, 5 x 4 floats) counts with the last layer's activations."""
    stage = Stage(torch.device("cpu"), lambda p: torch.optim.SGD(p, lr=0.1), seed=0)
    stage.add_layer(0, torch.nn.Linear(16, 4))
    clock = iter(range(1000)).__next__
    (segment,) = stage.segments(profile=True)
    out = stage.forward(0, segment, torch.randn(5, 16), input_grad=False, timer=lambda: float(clock()))
    stats = stage.layers[0].stats
    assert stats.input_bytes == 5 * 16 * 4 and stats.activation_bytes == 5 * 16 * 4  # Linear saves its input
    stage.attach_loss(0, segment, out, torch.nn.functional.cross_entropy, torch.zeros(5, dtype=torch.long),
                      timer=lambda: float(clock()))
    assert stats.activation_bytes >= 5 * 16 * 4 + 5 * 4 * 4


def test_a_tied_weight_is_named_with_its_bytes_by_each_layer_that_uses_it() -> None:
    """Two layers on one stage share a weight (one tensor here); each layer's figures count it, and each names it as
    shared with its bytes and its Adam state, so the cost model can take the second copy off."""
    first, second = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8)
    second.weight = first.weight
    stage = Stage(torch.device("cpu"), lambda p: torch.optim.Adam(p), seed=0)
    stage.add_layer(0, first, UnitTensors([("weight", "w")], []))
    stage.add_layer(1, second, UnitTensors([("weight", "w"), ("bias", "1.bias")], []))
    h = torch.randn(2, 8)
    for segment in stage.segments(profile=True):
        h = stage.forward(0, segment, h)
    g = (torch.ones_like(h),)
    for segment in reversed(stage.segments(profile=True)):
        g = stage.backward(0, segment, g)
    stage.step()
    docs = layer_costs(stage, {0: "a", 1: "b"}, shared={"w"})
    weight = 8 * 8 * 4
    assert [d.shared for d in docs] == [{"w": [weight, 2 * weight + 4]}] * 2  # Adam: two moments and a step count
    assert docs[0].cost.param_bytes == weight and docs[1].cost.param_bytes == weight + 8 * 4
    assert layer_costs(stage, {0: "a", 1: "b"})[0].shared == {}  # nothing named tied: nothing reported
