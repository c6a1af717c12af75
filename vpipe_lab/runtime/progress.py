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

    def take(self, command: str) -> None:
        """The controller's "pause", "resume" or "stop"."""
        if command not in ("pause", "resume", "stop"):
            raise ValueError(f"{command!r} is not a run-state command (pause, resume, stop)")
        self.paused = {"pause": True, "resume": False}.get(command, self.paused)
        self.stopping = self.stopping or command == "stop"

    @property
    def active(self) -> bool:
        return not self.paused and not self.stopping and (self.target is None or self.iteration < self.target)
