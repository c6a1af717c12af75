"""What a schedule reads of a plan (its layers per chunk and stage, their policies): a protocol, so the schedules
never import ``core/plan.py``, which imports them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from vpipe_lab.core.policy import Policy


class PlanView(Protocol):
    """``core.plan.Plan`` as the schedules see it."""

    @property
    def policies(self) -> tuple[Policy, ...]: ...

    @property
    def virtual_stages(self) -> int: ...

    def chunk_layers(self, chunk: int) -> range: ...

    def layers_of(self, stage: int) -> Sequence[int]: ...
