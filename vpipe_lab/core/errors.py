"""Exceptions raised by the planning core; each message names the offending value and how to fix it."""

from __future__ import annotations


class VpipeError(Exception):
    """Base class of every error vpipe_lab raises on purpose."""


class ProfileError(VpipeError, ValueError):
    """A profile, cluster or plan document has a missing or malformed field."""


class PlanError(VpipeError, ValueError):
    """A plan is malformed for the model or cluster it is applied to."""


class ScheduleError(VpipeError, ValueError):
    """A schedule is malformed or deadlocks; the message shows the schedule grid with the failing step marked."""


class InfeasiblePlan(VpipeError):
    """No plan of the requested kind fits the memory budget.

    ``stage`` is the stage that lacks memory, ``missing_bytes`` by how much, and ``suggestions`` what would help.
    """

    def __init__(self, message: str, *, stage: int, missing_bytes: int, suggestions: tuple[str, ...] = ()) -> None:
        self.stage = stage
        self.missing_bytes = missing_bytes
        self.suggestions = suggestions
        text = message
        if suggestions:
            text += " What would help: " + "; ".join(suggestions) + "."
        super().__init__(text)
