"""The words the front end shares with Python (memory policies, schedule names, shardings), written as the TypeScript
it imports.

``python -m vpipe_lab.core.vocabulary extension/src/vocabulary.ts`` writes them; ``.ci/run`` does so before the
widgets are built and fails when the committed file differs, so the editor's policies and schedules are Python's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from vpipe_lab.core.policy import Policy
from vpipe_lab.core.schedules.registry import BUILT_IN
from vpipe_lab.core.sharding import Sharding


def words() -> dict[str, list[str]]:
    """The shared vocabularies: the policies and a sharded stage's choices in their cycling order, the built-in
    schedules in the registry's."""
    return {"POLICIES": [p.value for p in Policy], "SCHEDULES": [k.name for k in BUILT_IN],
            "SHARDINGS": [s.value for s in Sharding]}


def typescript() -> str:
    """``words()`` as a TypeScript module of ``as const`` tuples (their literal types are the front end's types)."""
    lines = ["// Generated from Python by `python -m vpipe_lab.core.vocabulary` (core/vocabulary.py); do not edit by hand.",
             ""]
    for name, values in words().items():
        items = ", ".join(f'"{v}"' for v in values)
        lines.append(f"export const {name} = [{items}] as const;")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m vpipe_lab.core.vocabulary OUT.ts (e.g. extension/src/vocabulary.ts)")
    Path(args[0]).write_text(typescript())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
