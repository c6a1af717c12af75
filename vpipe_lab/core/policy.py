"""Where a layer's saved activations live between its forward and its backward: keep, swap or recompute."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from vpipe_lab.core.errors import PlanError


class Policy(StrEnum):
    """Where a layer's saved activations live between its forward and its backward."""

    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"

    @classmethod
    def parse(cls, value: Any) -> Policy:
        """Accept a Policy, its value or a unique prefix ("k", "s", "r"), case-insensitive."""
        if isinstance(value, Policy):
            return value
        text = str(value).strip().lower()
        matches = [p for p in cls if p.value.startswith(text)] if text else []
        if len(matches) != 1:
            raise PlanError(f"unknown policy {value!r}: use one of 'keep', 'swap', 'recompute'")
        return matches[0]

    def __str__(self) -> str:
        return self.value
