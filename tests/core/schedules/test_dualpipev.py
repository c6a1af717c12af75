"""DualPipeV's kind: the V, its eight phases on every stage, whole and split backwards, and its checks."""

from __future__ import annotations

from vpipe_lab.core import schedules
from vpipe_lab.core.schedules.actions import Op, run_schedule


def test_every_stage_runs_each_micro_batch_once_per_chunk_with_each_w_after_its_b() -> None:
    kind = schedules.get("dualpipev")
    for k in (2, 3, 4):
        for m in (2 * k, 2 * k + 1, 3 * k):
            for r, row in enumerate(kind.orders(k, 2, m)):
                mine = {r, 2 * k - 1 - r}
                for op in (Op.F, Op.B, Op.W):
                    done = sorted((c, mb) for o, c, mb in row if o is op)
                    assert done == sorted((c, mb) for c in mine for mb in range(m)), (k, m, r, op)
                seen: set[tuple[int, int]] = set()
                for op, c, mb in row:
                    if op is Op.B:
                        seen.add((c, mb))
                    elif op is Op.W:
                        assert (c, mb) in seen  # a weight step never before its input gradient
            whole = kind.full_backwards(k, m)
            assert whole and all(c in range(2 * k) and mb in range(m) for c, mb in whole)


def test_its_order_runs_without_a_bubble_beyond_the_fill_at_unit_costs() -> None:
    kind = schedules.get("dualpipev")
    built = kind.build(4, 16)
    assert built.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    took = run_schedule(built, lambda a: 1.0 if a.op in (Op.F, Op.B, Op.W) else 0.0).iteration_s
    assert took <= 1.05 * 2 * 16 * 3  # two chunks x M micro-batches x (F, B, W) per stage, plus a little fill


def test_it_needs_a_micro_batch_per_chunk() -> None:
    kind = schedules.get("dualpipev")
    assert kind.check(3, 5) == ("dualpipev needs at least as many micro-batches as chunks (2 x 3 stages = 6), not "
                                "microbatches=5")
    assert kind.check(3, 6) is None and kind.check_virtual(3) is not None
    assert kind.auto_virtuals(3, 6, 6) == (2,) and kind.auto_virtuals(3, 6, 5) == () and kind.auto_virtuals(3, 5, 6) == ()
    assert kind.torch is not None and kind.torch.name == "DualPipeV" and kind.torch.exact(3, 2, 6)
