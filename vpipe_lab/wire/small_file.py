"""Reading a file someone else wrote that should be small (a plan, a bundle's ``pipeline.json``, a torchtitan TOML,
a schedule CSV, a checkpoint's manifest): at most a bound's bytes from a regular file, so a symlink to
``/dev/zero`` or a FIFO is refused in one line instead of filling memory or blocking."""

from __future__ import annotations

import os
import stat
from pathlib import Path

LIMIT = 16 << 20  # 16 MiB: a 10,000-unit plan's JSON is about 1 MiB


class TooLarge(ValueError):
    """A file that is not a small regular file: larger than its bound, a device, a FIFO, a directory."""


def read_text(path: str | Path, what: str, limit: int = LIMIT) -> str:
    """The text of ``path`` (``what`` names it in errors), refused if it is not a regular file or is over ``limit``
    bytes. Raises OSError as ``open`` does for a missing or unreadable file."""
    target = Path(path)
    info = os.stat(target)  # follows a symlink: what would be read is what is checked
    if not stat.S_ISREG(info.st_mode):
        raise TooLarge(f"{what} {str(target)[:200]!r} is not a regular file (a device, a FIFO or a directory): "
                       "give the file itself")
    with open(target, "rb") as handle:
        data = handle.read(limit + 1)  # a file that grows while it is read is bounded all the same
    if len(data) > limit:
        raise TooLarge(f"{what} {str(target)[:200]!r} is larger than {limit >> 20} MiB, more than any file of its "
                       "kind this lab writes: check that it is the file you meant")
    return data.decode("utf-8", errors="strict")
