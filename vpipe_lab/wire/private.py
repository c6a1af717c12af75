"""Files that hold secrets (session keys, job specs, pickled user code): created owner-only, read only when private."""

from __future__ import annotations

import os
import stat
from pathlib import Path

DEFAULT_KEY_FILE = Path.home() / ".cache" / "vpipe_lab" / "torchrun.key"


def write_private(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 from the first byte: a new file is created with that mode (no window
    in which others may read it) and renamed over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_key(path: str | Path = DEFAULT_KEY_FILE) -> str:
    """A session key from a key file, refused when others may read it (a key others can read is no key)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"no key file at {path}: rank 0 of the job writes it on first start (or pass key=)") \
            from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"key file {path} can be read by other users (mode {oct(mode & 0o777)}); anyone who can "
                              f"read it can drive the job. Fix it with: chmod 600 {path}")
    return path.read_text().strip()
