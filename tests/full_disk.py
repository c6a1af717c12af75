"""A real file system that fills up, for the tests of what a full disk does: a small tmpfs mounted for the test where
this machine lets the test mount one (root in a container that allows it), else None (the tests then inject ENOSPC)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_filesystem(parent: Path, size_kib: int) -> Iterator[Path | None]:
    """A directory under ``parent`` on a tmpfs of ``size_kib`` KiB, unmounted afterwards; None where none can be made."""
    target = parent / f"full-{uuid.uuid4().hex[:8]}"
    target.mkdir()
    mount = shutil.which("mount")
    made = mount is not None and subprocess.run([mount, "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(target)],
                                                capture_output=True, timeout=30).returncode == 0
    try:
        yield target if made else None
    finally:
        if made:
            subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)


def fill(path: Path, leave: int = 0) -> None:
    """Fill the file system of ``path`` until at most ``leave`` bytes are free."""
    import os

    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    with open(path / "ballast", "wb") as handle:
        chunk = b"\0" * 4096
        while free > leave:
            try:
                handle.write(chunk[: max(1, min(len(chunk), free - leave))])
                handle.flush()
            except OSError:
                break
            free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
