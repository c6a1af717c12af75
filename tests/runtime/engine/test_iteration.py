"""The walk over a stage's row: every action kind has its method, and transfers into each chunk a tag of its own."""

from __future__ import annotations

from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules.actions import Op
from vpipe_lab.runtime.engine.comm import TAG_BACKWARD, TAG_FORWARD
from vpipe_lab.runtime.engine.iteration import COMM, StageIteration, chunk_tag, tag_into


def test_every_action_kind_but_recompute_has_a_method() -> None:
    """RECOMPUTE is run inside B, right before the layer's own backward (vPipe's order); every other kind the IR
    knows must have a method, or a schedule using it would fail mid-iteration on the workers."""
    names = {"receive_input", "forward", "send_output", "swap_out", "swap_in", "receive_gradient", "backward",
             "weight_step", "send_gradient"}
    assert all(callable(getattr(StageIteration, n)) for n in names)
    assert len(names) == len(Op) - 1 and set(COMM) == {Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B}


def test_chunk_streams_have_tags_of_their_own_only_with_virtual_stages() -> None:
    flat = Plan.from_counts([2, 2], 4)
    looped = Plan((0, 1, 2, 3, 4), ("keep",) * 4, 4, "interleaved-1f1b", 2)
    assert tag_into(Op.RECV_F, 1, flat) == tag_into(Op.SEND_F, 1, flat) == TAG_FORWARD
    assert tag_into(Op.RECV_B, 0, flat) == TAG_BACKWARD
    assert [tag_into(Op.RECV_F, c, looped) for c in range(4)] == [TAG_FORWARD + 8 * c for c in range(4)]
    assert len({chunk_tag(TAG_FORWARD, c, looped) for c in range(4)} | {chunk_tag(TAG_BACKWARD, c, looped)
                                                                        for c in range(4)}) == 8


def test_an_iteration_leaves_no_reference_cycle_holding_its_tensors() -> None:
    """Whatever an iteration held (inputs, activations, the walk itself) is freed when it ends, by reference counts:
    a cycle would keep it, tensors included, until Python's next full collection, minutes later in a big process."""
    import gc

    import torch

    from tests.runtime.engine.test_executor import executor
    from vpipe_lab.examples import mlp

    ex, plan = executor("ksrksrksrk", "1f1b")
    ex.run(0, plan, mlp.data(0))  # warm: whatever is made once and kept
    ex.stage.step()
    gc.collect()
    gc.disable()  # nothing collected behind the test's back
    try:
        flags = gc.get_debug()
        gc.set_debug(flags | gc.DEBUG_SAVEALL)
        try:
            ex.run(1, plan, mlp.data(1))
            ex.stage.step()
            gc.collect()
            held = [type(o).__qualname__ for o in gc.garbage
                    if isinstance(o, (torch.Tensor, StageIteration)) or type(o).__name__ == "IterationResult"]
        finally:
            gc.garbage.clear()
            gc.set_debug(flags)
    finally:
        gc.enable()
        gc.collect()
    assert held == [], held
