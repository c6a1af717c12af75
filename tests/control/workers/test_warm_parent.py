"""The warm worker parent: a worker forked from it reports its exit like a Popen, gets the caller's environment, and
one zygote serves one environment (a changed variable gets its own)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from vpipe_lab.control.workers import warm_parent as Z


def test_a_forked_worker_runs_the_worker_entry_point_and_reports_its_exit(tmp_path: Path) -> None:
    z = Z.Zygote(dict(os.environ), os.getcwd())
    read, write = os.pipe()
    try:
        log = tmp_path / "worker.log"
        with open(log, "wb") as out:
            worker = z.fork(["--config", str(tmp_path / "missing.json"), "--rank", "0"], out.fileno(), read,
                            {**os.environ, "VPIPE_LAB_PROBE": "seen"})
        assert worker.wait(timeout=30) == 1 and worker.poll() == 1
        assert "missing.json" in log.read_text()  # the worker's own error, in its own log
    finally:
        os.close(read)
        os.close(write)
        z.close()
    assert z.process.returncode == 0  # the zygote leaves once its controller closes the socket


def test_one_zygote_per_environment_and_the_newest_replaces_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    first = Z.zygote()
    deadline = time.monotonic() + 60
    while not first.ready and time.monotonic() < deadline:  # serving, so a close is answered by leaving (exit 0)
        time.sleep(0.05)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "something else")  # volatile: the same zygote
    assert Z.zygote() is first
    monkeypatch.setenv("VPIPE_LAB_MAX_COMMAND", "1234")  # read at import time: another zygote
    other = Z.zygote()
    assert other is not first and first.closed and first.process.wait(timeout=5) == 0  # replaced, and gone
    monkeypatch.setenv("VPIPE_LAB_ZYGOTE", "0")
    assert not Z.enabled()


def test_closing_a_zygote_still_importing_torch_ends_it_at_once(tmp_path: Path) -> None:
    z = Z.Zygote(dict(os.environ), str(tmp_path))
    assert not z.ready  # torch takes seconds to import
    start = time.monotonic()
    z.close()
    assert z.process.returncode == -signal.SIGKILL and time.monotonic() - start < 1.5
