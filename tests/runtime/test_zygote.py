"""The zygote's child: its own session, the request's environment and directory, and a Popen-style exit status."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from vpipe_lab.control.workers.warm_parent import Zygote


def test_children_lead_their_own_session_and_a_signal_is_their_exit_status(tmp_path: Path) -> None:
    # A config that is a FIFO nobody writes: the child blocks reading it, alive, until it is killed.
    fifo = tmp_path / "job.json"
    os.mkfifo(fifo)
    z = Zygote(dict(os.environ), str(tmp_path))
    read, write = os.pipe()
    try:
        with open(tmp_path / "w.log", "wb") as out:
            worker = z.fork(["--config", str(fifo), "--rank", "0"], out.fileno(), read, dict(os.environ))
        deadline = time.monotonic() + 20
        while os.getsid(worker.pid) != worker.pid and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.getsid(worker.pid) == worker.pid and worker.poll() is None
        assert os.readlink(f"/proc/{worker.pid}/cwd") == str(tmp_path)
        os.killpg(worker.pid, signal.SIGKILL)
        assert worker.wait(timeout=10) == -signal.SIGKILL
    finally:
        os.close(read)
        os.close(write)
        z.close()


def test_building_an_optimizer_in_a_child_imports_nothing_more() -> None:
    """torch.optim imports torch._dynamo on an optimizer's first construction (2.5 s on a 2-core CPU); the zygote has
    it imported already, so a forked worker building its optimizer loads no module of its own."""
    code = ("import sys, torch, vpipe_lab.runtime.zygote; before = set(sys.modules); "
            "torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1); "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_preload_imports_what_it_is_asked_and_leaves_failures_to_the_workers() -> None:
    code = ("import sys, logging; logging.basicConfig(); from vpipe_lab.runtime import zygote; "
            "assert 'transformers' not in sys.modules; zygote.preload('transformers, no_such_module_xyz'); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "True" and "could not preload 'no_such_module_xyz'" in out.stderr
