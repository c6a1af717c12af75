"""ZBV's kind: the V placement, two chunks per stage only, and the iteration of its closed form."""

from vpipe_lab.core import schedules


def test_zbv() -> None:
    kind = schedules.get("zbv")
    assert kind.placement(3, 6) == (0, 1, 2, 2, 1, 0) and kind.default_virtual == 2 and kind.split_backward
    assert kind.check_virtual(2) is None and kind.check_virtual(4) is not None
    assert [kind.inflight(2, c, 4, 2) for c in range(4)] == [4, 3, 2, 1]  # the way down holds more
    assert kind.chunks_iteration_time([1.0] * 4, [0.0] * 4, 2, 4) > 0
    assert kind.torch is not None and kind.torch.style == "v" and kind.torch.exact(3, 2, 5)
