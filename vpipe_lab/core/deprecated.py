"""A name kept for one release after it left the public face (the Session's stray attributes), or a module's old import
path after it was renamed: it still answers, the attribute with a DeprecationWarning naming what to use."""

from __future__ import annotations

import operator
import sys
import warnings
from types import ModuleType
from typing import Any


def moved(old: str, module: ModuleType) -> None:
    """``import old`` answers with ``module`` (renamed for what it is: issue #59's names that repeat) for one release."""
    sys.modules.setdefault(old, module)


class Deprecated:
    """A read-only class attribute aliasing the instance's private ``attribute`` (a dotted path reaches into a
    collaborator); ``instead`` says what to use."""

    def __init__(self, attribute: str, instead: str) -> None:
        self.attribute, self.instead = attribute, instead
        self.name = attribute.lstrip("_")

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        warnings.warn(f"{type(obj).__name__}.{self.name} is deprecated and goes in the next release: use {self.instead}",
                      DeprecationWarning, stacklevel=2)
        return operator.attrgetter(self.attribute)(obj)
