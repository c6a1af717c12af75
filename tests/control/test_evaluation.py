"""How Session.evaluate names its data to the workers."""

from __future__ import annotations

from pathlib import Path

import cloudpickle
import pytest

from vpipe_lab.control.evaluation import JOB_DATA, data_ref


def test_references(tmp_path: Path) -> None:
    launched = tmp_path  # a launched session's job directory
    assert data_ref(launched, None) == JOB_DATA
    assert data_ref(launched, "mlp") == "mlp"
    ref = data_ref(launched, lambda i: (i, i))
    assert ref.startswith("file:") and cloudpickle.loads(Path(ref[5:]).read_bytes())(3) == (3, 3)
    assert Path(ref[5:]).stat().st_mode & 0o077 == 0  # private: only its owner reads what a worker unpickles


def test_an_attached_session_cannot_ship_a_function() -> None:
    with pytest.raises(ValueError, match="importable on every node"):
        data_ref(None, lambda i: i)
