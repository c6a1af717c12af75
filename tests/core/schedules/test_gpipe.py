"""GPipe's kind: its order, its in-flight count and its closed-form iteration, and torch's class for it."""

from vpipe_lab.core import schedules
from vpipe_lab.core.schedules.actions import Op


def test_gpipe() -> None:
    kind = schedules.get("gpipe")
    assert kind.orders(2, 1, 2)[1] == [(Op.F, 1, 0), (Op.F, 1, 1), (Op.B, 1, 0), (Op.B, 1, 1)]
    assert kind.inflight(3, 2, 8, 1) == 8 and kind.flush == "gpipe"
    assert kind.iteration_time([1, 3], [3, 1], 3) == 8 + 2 * (3 + 3)
    assert kind.torch is not None and kind.torch.name == "GPipe" and kind.torch.exact(4, 1, 1)
