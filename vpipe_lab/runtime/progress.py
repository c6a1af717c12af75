"""Where a rank stands: the iteration it runs next and what the controller asked for (run, pause, stop)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Control:
    """Where this rank stands: the iteration it runs next and what the controller asked for."""

    iteration: int = 0
    target: int | None = 0  # run until this iteration (None: until stopped)
    paused: bool = False
    stopping: bool = False
    plan_version: int = 0

    @property
    def active(self) -> bool:
        return not self.paused and not self.stopping and (self.target is None or self.iteration < self.target)
