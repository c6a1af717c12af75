"""1F1B and eager 1F1B: warm-up forwards, in-flight counts, and which torch class runs them exactly."""

from vpipe_lab.core import schedules
from vpipe_lab.core.schedules.actions import Op


def test_one_f_one_b_and_its_eager_variant() -> None:
    plain, eager = schedules.get("1f1b"), schedules.get("eager-1f1b")
    assert plain.orders(2, 1, 3)[0][:3] == [(Op.F, 0, 0), (Op.F, 0, 1), (Op.B, 0, 0)]
    assert eager.orders(2, 1, 3)[0][:3] == [(Op.F, 0, 0), (Op.F, 0, 1), (Op.F, 0, 2)]
    assert [plain.inflight(3, s, 8, 1) for s in range(3)] == [3, 2, 1]
    assert [eager.inflight(3, s, 8, 1) for s in range(3)] == [4, 3, 1]
    assert plain.torch is not None and plain.torch.exact(4, 1, 4) and not plain.torch.exact(4, 1, 3)
    assert eager.torch is not None and not eager.torch.exact(2, 1, 8)  # torch's 1F1B warms up one less
