"""Secret files: owner-only from the first byte, and refused when others can read them."""

import os
import stat
from pathlib import Path

import pytest

from vpipe_lab.wire.private import read_key, write_private


def test_written_owner_only_even_under_a_loose_umask(tmp_path: Path) -> None:
    old = os.umask(0o000)
    try:
        write_private(tmp_path / "k", b"secret")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600
    assert read_key(tmp_path / "k") == "secret"
    assert [p.name for p in tmp_path.iterdir()] == ["k"]  # no temporary left behind


def test_a_key_others_can_read_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "torchrun.key"
    path.write_text("secret")
    path.chmod(0o644)
    with pytest.raises(PermissionError, match=rf"can be read by other users \(mode 0o644\).*chmod 600 {path}"):
        read_key(path)
    with pytest.raises(FileNotFoundError, match="no key file"):
        read_key(tmp_path / "missing")
