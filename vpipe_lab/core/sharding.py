"""How a sharded stage (FSDP2 inside a pipeline stage) holds its gathered parameters and its unsharded gradients
over an iteration: the two choices FSDP gives each stage, searched by the planners as vPipe searches swap and
recompute (standard library only)."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from vpipe_lab.core.errors import PlanError


class Sharding(StrEnum):
    """When a sharded stage all-gathers its parameters and reduce-scatters its gradients, per unit.

    - ``hold``: gather once, before the stage's first forward; keep the whole parameters and accumulate whole
      gradients until the stage's last backward, then reduce-scatter once. One all-gather and one reduce-scatter per
      iteration; the most memory (whole parameters and gradients of the stage all iteration). torchtitan's FSDP + PP
      layout (``fsdp_reshard_after_forward`` "never" under PP, torch's pipelining reducing at the last backward).
    - ``regather``: reshard after every forward and backward, all-gather again before each (FSDP's
      ``reshard_after_forward=True``); whole gradients still accumulate over the iteration. 2 M all-gathers, one
      reduce-scatter; parameters whole only for the unit that computes.
    - ``scatter``: keep the gathered parameters; reduce-scatter the gradients after every micro-batch's backward
      (gradients whole only within one micro-batch). One all-gather, M reduce-scatters.
    - ``stream``: both per micro-batch (ZeRO-3 as FSDP runs it outside a pipeline): 2 M all-gathers and M
      reduce-scatters; the least memory.
    """

    HOLD = "hold"
    REGATHER = "regather"
    SCATTER = "scatter"
    STREAM = "stream"

    @property
    def reshard_after_forward(self) -> bool:
        """Parameters are resharded after each forward (and backward) and gathered again before the next."""
        return self in (Sharding.REGATHER, Sharding.STREAM)

    @property
    def reduce_per_microbatch(self) -> bool:
        """Gradients are reduce-scattered after each micro-batch's backward instead of once per iteration."""
        return self in (Sharding.SCATTER, Sharding.STREAM)

    @classmethod
    def of(cls, reshard_after_forward: bool, reduce_per_microbatch: bool) -> Sharding:
        """The choice with these two answers."""
        return {(False, False): cls.HOLD, (True, False): cls.REGATHER, (False, True): cls.SCATTER,
                (True, True): cls.STREAM}[(bool(reshard_after_forward), bool(reduce_per_microbatch))]

    @classmethod
    def parse(cls, value: Any) -> Sharding:
        """A Sharding, its value or a unique prefix, case-insensitive."""
        if isinstance(value, Sharding):
            return value
        text = str(value).strip().lower()
        matches = [s for s in cls if s.value.startswith(text)] if text else []
        if len(matches) != 1:
            raise PlanError(f"unknown sharding {value!r}: use one of {', '.join(repr(s.value) for s in cls)} "
                            "(when a sharded stage gathers its parameters and reduces its gradients)")
        return matches[0]

    def __str__(self) -> str:
        return self.value
