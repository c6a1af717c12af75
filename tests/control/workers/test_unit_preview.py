from __future__ import annotations

import pytest

from vpipe_lab.control.workers import unit_preview


def test_a_model_is_known_by_what_was_sent_to_the_workers() -> None:
    key = unit_preview.fingerprint(b"pickled model", {"data": "mlp"})
    assert key == unit_preview.fingerprint(b"pickled model", {"data": "mlp"})
    assert key != unit_preview.fingerprint(b"pickled model", {"data": "gpt-tiny"})
    assert key != unit_preview.fingerprint(b"another model", {"data": "mlp"})
    assert unit_preview.known(key) is None
    unit_preview.remember(key, ["a", "b", "c"])
    assert unit_preview.known(key) == ["a", "b", "c"]


def test_more_stages_than_units_is_refused_with_what_would_work() -> None:
    unit_preview.check(3, ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"3 partition units \(a, b, c\).*at most 3 stages, not 4.*between 1 and 3"):
        unit_preview.check(4, ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"\.\.\. \(8 more\)"):
        unit_preview.check(30, [f"h.{i}" for i in range(20)])
