"""What the controller knows of a model's partition units before its workers start, so a pipeline the model cannot
fill is refused in seconds instead of after every worker has started: a bundled example declares its units; a model
this process launched before is remembered by a fingerprint of what was sent to the workers; for any other model
``launch()`` starts rank 0 alone and waits for its report (``JobSpec.scout``) when more than two workers would start.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping, Sequence

_KNOWN: dict[str, list[str]] = {}  # fingerprint -> the units' names
_LOCK = threading.Lock()
SCOUT_ABOVE = 2  # up to this many workers start together (as fast as one alone on a small machine); more wait


def fingerprint(callables: bytes | None, named: Mapping[str, str]) -> str:
    """A key for "the same model again": the pickled user callables (model, data, split, ...) and bundled names."""
    digest = hashlib.sha256(callables or b"")
    digest.update(json.dumps(dict(sorted(named.items()))).encode())
    return digest.hexdigest()


def known(key: str) -> list[str] | None:
    with _LOCK:
        names = _KNOWN.get(key)
        return list(names) if names is not None else None


def remember(key: str, names: Sequence[str]) -> None:
    with _LOCK:
        _KNOWN[key] = list(names)


def check(stages: int, names: Sequence[str]) -> None:
    """Refuse a pipeline of more stages than the model has partition units, naming what would work."""
    if stages > len(names):
        shown = ", ".join(names[:12]) + (f", ... ({len(names) - 12} more)" if len(names) > 12 else "")
        raise ValueError(f"the model has {len(names)} partition units ({shown}), so a pipeline of it has at most "
                         f"{len(names)} stages, not {stages}: use stages between 1 and {len(names)}, or cut it into "
                         "more units with split=[module names]")
