"""Shared fixtures: an isolated state directory, and a check that no worker process outlives any test."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import psutil
import pytest

# The workers of the HuggingFace tests fork with transformers imported (runtime/zygote.py's preload): 1.5 s less per
# GPT-2 launch. Set before any test starts a zygote, so all of them share one environment.
os.environ.setdefault("VPIPE_LAB_PRELOAD", "transformers")


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process started with ``start_new_session`` and everything it started (a torchrun agent and its
    workers: a whole node gone), then reap it."""
    if proc.poll() is None:
        family = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for child in family:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    proc.wait(timeout=30)


def worker_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if "vpipe_lab.runtime.process" in cmd or "vpipe-lab worker" in cmd:
            if proc.info.get("status") != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


@pytest.fixture(autouse=True, scope="session")
def _state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    os.environ["VPIPE_LAB_STATE_DIR"] = str(tmp_path_factory.mktemp("vpipe-state"))
    yield


@pytest.fixture(autouse=True)
def no_orphan_workers() -> Iterator[None]:
    """Fail the test if any worker process it started is still alive shortly after it ends."""
    before = {p.pid for p in worker_processes()}
    yield
    deadline = time.monotonic() + 10
    left: list[psutil.Process] = []
    while time.monotonic() < deadline:
        left = [p for p in worker_processes() if p.pid not in before]
        if not left:
            return
        time.sleep(0.1)
    for p in left:
        p.kill()
    pytest.fail(f"worker processes outlived the test: {[p.pid for p in left]}")
