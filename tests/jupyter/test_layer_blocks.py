"""The editor's blocks: a re-measure eases each block toward its new share instead of jumping."""

from __future__ import annotations

import pytest

from vpipe_lab.jupyter.layer_blocks import EASE, steady_weights


def test_re_measured_sizes_ease_in_instead_of_jumping() -> None:
    first = steady_weights(None, [1.0, 1.0, 2.0])
    assert first == [0.25, 0.25, 0.5]
    moved = steady_weights(first, [3.0, 0.0, 1.0])  # a very different measurement (params -> times, say)
    assert moved[0] == pytest.approx(0.25 + EASE * (0.75 - 0.25)) and sum(moved) == pytest.approx(1.0)
    assert max(abs(a - b) for a, b in zip(first, moved)) <= EASE * 0.5 + 1e-9  # one step moves a block that far at most
    settled = first
    for _ in range(30):
        settled = steady_weights(settled, [3.0, 0.0, 1.0])
    assert settled == pytest.approx([0.75, 0.0, 0.25], abs=1e-4)  # repeated measurements converge to the truth
    assert steady_weights(first, [1.0, 1.0]) == [0.5, 0.5]  # another model starts over
    assert steady_weights(None, [0.0, 0.0]) == [0.5, 0.5]
