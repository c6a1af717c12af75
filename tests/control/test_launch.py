import pytest

from vpipe_lab.control.launch import _budgets, _free_port


def test_budgets() -> None:
    assert _budgets(None, 3) is None
    assert _budgets(10, 2) == [10, 10]
    assert _budgets([1, 2], 2) == [1, 2]
    with pytest.raises(ValueError, match="one positive int or 3 of them"):
        _budgets([1, 2], 3)
    with pytest.raises(ValueError, match="memory_budget"):
        _budgets([0, 5], 2)


def test_free_port() -> None:
    assert 0 < _free_port("127.0.0.1") < 65536
