"""What a ``%vpipe`` command's handlers read of the magic that runs them: the notebook's namespace, the views it keeps
alive, the session to act on and a notebook variable by name (``magics.VpipeMagics`` is the one host)."""

from __future__ import annotations

from typing import Any, Protocol


class MagicHost(Protocol):
    """The ``%vpipe`` magic, as the handlers of its sub-commands see it."""

    shell: Any  # IPython's: ``user_ns`` is the notebook's namespace
    views: list[Any]  # widgets the magic returned, kept alive while their session runs

    def need(self) -> Any:
        """The session to act on (UsageError when there is none)."""

    def value(self, name: str, what: str) -> Any:
        """The notebook variable ``name``, holding ``what`` (UsageError naming it when there is none)."""
