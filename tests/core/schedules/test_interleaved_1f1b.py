"""Interleaved 1F1B's kind: looped chunks, micro-batches in groups of the stages, what "auto" tries."""

from vpipe_lab.core import schedules


def test_interleaved() -> None:
    kind = schedules.get("interleaved-1f1b")
    assert kind.chunked and kind.default_virtual == 2 and kind.placement(2, 6) == (0, 1, 0, 1, 0, 1)
    assert kind.check(2, 3) == ("interleaved-1f1b runs micro-batches in groups of the 2 stages: microbatches=3 must "
                                "be a multiple of 2")
    assert kind.check(2, 4) is None
    assert kind.auto_virtuals(2, 8, 4) == (2, 3, 4) and kind.auto_virtuals(2, 5, 4) == (2,)
    assert kind.auto_virtuals(2, 8, 3) == () and kind.auto_virtuals(2, 8, None) == ()
    assert kind.build(2, 4, virtual=3).placement == (0, 1, 0, 1, 0, 1)
