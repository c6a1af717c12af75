"""Mixed precision for a pipeline stage: ``torch.autocast`` on the compute, and an fp16 loss scale every stage agrees on.

Parameters, their gradients and the optimizer state stay float32 (autocast casts weights per op, caching the casts
within a region), so a checkpoint or a migration never sees a half-precision weight. bf16 has float32's range and
needs no scaling. fp16 does: the loss is multiplied by the scale before backward, so every gradient that crosses
between stages is scaled too; before the step each stage unscales its own gradients and checks them for inf/NaN, and
the stages agree (one all-reduce) whether anyone overflowed. Then every stage skips the same step and changes the
scale the same way, as ``torch.amp.GradScaler`` does in one process (same defaults: 2**16, x2 after 2000 good steps,
x0.5 after an overflow). GradScaler itself cannot be used: its overflow flag is per process, and a stage that steps
while another skips would leave the pipeline's weights out of step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

import torch

from vpipe_lab.core.settings import PRECISIONS

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(_DTYPES) == PRECISIONS, "every precision of core/settings.py needs its dtype here"


def check(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return precision


def autocast(precision: str, device: torch.device) -> Callable[[], AbstractContextManager[object]]:
    """A factory of the context the stage's compute runs in (a fresh one per use: autocast contexts do not nest
    re-entrantly)."""
    dtype = _DTYPES[check(precision)]
    if dtype is None:
        return nullcontext
    kind = device.type
    return lambda: torch.autocast(kind, dtype=dtype)


class LossScale:
    """The fp16 loss scale of one stage; every stage holds the same value because each update uses the verdict all
    stages agreed on."""

    def __init__(self, enabled: bool, init: float = 2.0 ** 16, growth: float = 2.0, backoff: float = 0.5,
                 interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init if enabled else 1.0
        self.growth, self.backoff, self.interval = growth, backoff, interval
        self.good = 0  # steps since the last overflow or growth

    def unscale(self, grads: Iterable[torch.Tensor]) -> torch.Tensor | None:
        """Divide the gradients by the scale in place; returns a 0-dim tensor, 1.0 when any is inf/NaN (on the
        gradients' device: reading it waits for them), or None when not scaling or no gradient."""
        grads = list(grads)
        if not self.enabled or not grads:
            return None
        torch._foreach_mul_(grads, 1.0 / self.scale)
        bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
        return bad.to(torch.float32)

    def update(self, overflow: bool) -> None:
        """After the stages agreed: back off on an overflow, grow after ``interval`` good steps."""
        if not self.enabled:
            return
        if overflow:
            self.scale *= self.backoff
            self.good = 0
        else:
            self.good += 1
            if self.good == self.interval:
                self.scale *= self.growth
                self.good = 0

    def state(self) -> dict[str, float]:
        return {"scale": self.scale, "good": self.good}

    def load(self, state: dict[str, float]) -> None:
        if self.enabled and state:
            self.scale, self.good = float(state["scale"]), int(state["good"])
