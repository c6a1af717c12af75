"""The one check of counts and sizes every entry point uses (launch, Session, the job spec, the planners, the
evaluation pass): a whole number of at least some minimum, or a positive number, named in the error with the value
given and, where it helps, what it counts."""

from __future__ import annotations

from typing import Any


def count(value: Any, name: str, minimum: int = 1, *, optional: bool = False,
          error: type[Exception] = ValueError, what: str = "", maximum: int | None = None) -> None:
    """Refuse (``error``) a ``value`` that is not a whole number >= ``minimum`` (and <= ``maximum`` where one is
    given; None passes when ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None
                                                                                     and value > maximum):
        extra = f" ({what})" if what else ""
        either = " or None" if optional else ""
        span = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise error(f"{name} must be a whole number {span}{either}{extra}, got {value!r}")


def positive(value: Any, name: str, *, optional: bool = False, error: type[Exception] = ValueError,
             what: str = "") -> None:
    """Refuse (``error``) a ``value`` that is not a number > 0 (None passes when ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        extra = f" ({what})" if what else ""
        raise error(f"{name} must be a positive number{extra}, got {value!r}")
