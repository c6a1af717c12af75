"""What a profile counts more than once on a stage that holds several units using one parameter (a tied weight)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from vpipe_lab.core.profile import SharedTensor


class SharedBytes:
    """Each unit's ``param_bytes`` and ``optimizer_bytes`` count every parameter it uses, a tied one included (it
    needs it wherever it lives); a stage whose units share one holds it once. This gives what to take off."""

    def __init__(self, shared: Sequence[SharedTensor]) -> None:
        self.shared = tuple(shared)

    def extra(self, lo: int, hi: int) -> tuple[int, int]:
        """(static bytes, parameter bytes) that layers lo:hi's sums count more than once."""
        static = params = 0
        for tensor in self.shared:  # a model ties a handful of tensors at most
            copies = bisect_left(tensor.units, hi) - bisect_left(tensor.units, lo) - 1
            if copies > 0:
                static, params = static + copies * tensor.static_bytes, params + copies * tensor.param_bytes
        return static, params

    def across(self, ranges: Sequence[range]) -> int:
        """Static bytes that a stage's sum over its chunks' ``ranges`` counts more than once beyond what each chunk
        takes off itself: a tensor two chunks of one stage share (ZBV's first and last: a tied embedding and head)."""
        held = {i for layers in ranges for i in layers}
        whole = sum(max(0, len(held.intersection(t.units)) - 1) * t.static_bytes for t in self.shared)
        return whole - sum(self.extra(layers.start, layers.stop)[0] for layers in ranges)
