"""nbval runs the tutorials; after each notebook, no worker process may survive it."""

from __future__ import annotations

import time

import psutil
import pytest


def _workers() -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if "vpipe_lab.runtime.worker" in " ".join(proc.info.get("cmdline") or []) and \
                proc.info.get("status") != psutil.STATUS_ZOMBIE:
            out.append(proc)
    return out


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is not None and nextitem.fspath == item.fspath:
        return  # still inside the same notebook
    deadline = time.monotonic() + 15
    while _workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _workers()
    for proc in left:
        proc.kill()
    if left:
        raise AssertionError(f"{item.fspath.basename}: worker processes survived the notebook: {[p.pid for p in left]}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A tutorial starts real workers: it belongs to the slow tier (``pytest -m "not slow"`` leaves them out)."""
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.slow)
