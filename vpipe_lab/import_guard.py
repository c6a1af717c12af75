"""The torchvision guard for the user's own process: armed by ``import vpipe_lab``, run when torchvision is first sought.

The workers call ``runtime.model.compat.allow_torchvision_without_ops`` before they build a model. The user's kernel
needs the same (a PyPI torchvision next to a CPU-only torch cannot load its compiled ops, and its import error takes
``transformers`` down with it), but ``import vpipe_lab`` must not import torch. So the package puts a finder at the
front of ``sys.meta_path`` that does nothing until something looks for ``torchvision`` (an ``import torchvision``, or
transformers' ``find_spec`` probe); it then takes itself out, runs the guard (which imports torch, as torchvision is
about to anyway) and lets the import go on as usual.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

log = logging.getLogger(__name__)


class TorchvisionGuard(importlib.abc.MetaPathFinder):
    """Finds nothing itself: the first lookup of ``torchvision`` runs the guard, then the usual finders answer."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if fullname != "torchvision":
            return None
        disarm()  # first: the guard looks torchvision up itself
        try:
            compat = importlib.import_module("vpipe_lab.runtime.model.compat")
            compat.allow_torchvision_without_ops()
        except Exception as exc:  # the guard must never be what breaks an import
            log.warning("the torchvision guard could not run (%s: %s); importing torchvision as it is",
                        type(exc).__name__, exc)
        return None


def arm() -> bool:
    """Put the guard in front of the import system, unless torchvision is imported already or it is there; whether
    it was put there."""
    if "torchvision" in sys.modules or any(isinstance(f, TorchvisionGuard) for f in sys.meta_path):
        return False
    sys.meta_path.insert(0, TorchvisionGuard())
    return True


def disarm() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, TorchvisionGuard)]
