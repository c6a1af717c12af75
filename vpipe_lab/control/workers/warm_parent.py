"""The controller's side of the warm worker parent (``runtime/zygote.py``): start it once, ask it for workers.

A worker forked from the zygote starts about 4 s sooner than a fresh interpreter on a 2-core CPU (torch and
``torch._dynamo``, which building an optimizer imports, are imported already).
One zygote serves every launch made with the same environment, directory and interpreter; a launch under another
(a changed ``VPIPE_LAB_*`` variable, say) gets a new zygote, which replaces the old one, so a worker always sees what
it would have seen started directly. Workers of a replaced zygote run on; only their exit statuses are lost (a
handle then reads -1 once the process is gone). ``VPIPE_LAB_ZYGOTE=0`` turns it off. Workers get a ``Popen``-like
handle (``ForkedWorker``): ``pid``, ``poll()``, ``wait()`` and ``returncode``, from the exit statuses the zygote
reports.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def enabled() -> bool:
    return os.environ.get("VPIPE_LAB_ZYGOTE", "1") not in ("0", "false", "no", "off")


class ForkedWorker:
    """A worker the zygote forked, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """One running ``python -m vpipe_lab.runtime.zygote`` and the socket to it."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.env, self.cwd = env, cwd
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vpipe_lab.runtime.zygote", str(theirs.fileno())], pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL, start_new_session=True, env=env, cwd=cwd)
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()  # one request at a time: its answer is the next pid message
        self._cond = threading.Condition()
        self._pids: list[int] = []
        self._codes: dict[int, int] = {}
        self.closed = False
        self.ready = False  # it has imported torch and serves requests
        threading.Thread(target=self._read, name="vpipe-zygote", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self.closed = True
                    self._cond.notify_all()
                    return
                doc = json.loads(data)
                if "ready" in doc:
                    self.ready = True
                elif "pid" in doc:
                    self._pids.append(int(doc["pid"]))
                else:
                    self._codes[int(doc["exit"])] = int(doc["code"])
                self._cond.notify_all()

    def fork(self, argv: list[str], log_fd: int, parent_fd: int, env: dict[str, str], timeout: float = 60.0
             ) -> ForkedWorker:
        """A worker running ``python -m vpipe_lab.runtime.process *argv`` with ``env``, logging to ``log_fd``."""
        request = json.dumps({"argv": argv, "env": env, "cwd": self.cwd}).encode()
        with self._lock:
            self.sock.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                           bytes(memoryview(_ints(log_fd, parent_fd))))])
            deadline = time.monotonic() + timeout
            with self._cond:
                while not self._pids:
                    if self.closed or time.monotonic() > deadline:
                        raise RuntimeError("the worker zygote did not answer (it died, or it is still importing "
                                           "torch); set VPIPE_LAB_ZYGOTE=0 to start workers directly")
                    self._cond.wait(0.1)
                return ForkedWorker(self, self._pids.pop(0))

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._codes:
                return self._codes[pid]
            if self.closed:  # the zygote is gone, and with it the exit statuses: judge by the pid alone
                return None if _running(pid) else -1
            return None

    def close(self) -> None:
        with self._cond:
            self.closed = True
            starting = not self.ready
        if starting:  # still importing torch: it has forked nothing, and would hear the close only once imported
            self.process.kill()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread and tells the zygote to go
        except OSError:
            pass
        self.sock.close()
        try:
            self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _ints(*values: int) -> bytes:
    import array

    return array.array("i", values).tobytes()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


_ZYGOTES: dict[str, Zygote] = {}
_GUARD = threading.Lock()


VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})  # changes with every test, read by nothing a worker imports


def zygote() -> Zygote:
    """The zygote for this process's current environment and directory (started on first use)."""
    env, cwd = dict(os.environ), os.getcwd()
    stable = sorted((k, v) for k, v in env.items() if k not in VOLATILE)
    key = hashlib.sha256(json.dumps([sys.executable, cwd, stable]).encode()).hexdigest()
    with _GUARD:
        found = _ZYGOTES.get(key)
        if found is None or found.closed or found.process.poll() is not None:
            for old in _ZYGOTES.values():  # one at a time: an environment left behind does not keep its zygote
                old.close()
            _ZYGOTES.clear()
            found = _ZYGOTES[key] = Zygote(env, cwd)
            log.debug("started a worker zygote (pid %d) for %s", found.process.pid, Path(cwd))
        return found


@atexit.register
def close_all() -> None:
    with _GUARD:
        for z in _ZYGOTES.values():
            z.close()
        _ZYGOTES.clear()
