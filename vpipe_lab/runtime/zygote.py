"""A warm parent for worker processes: torch and the runtime imported once, then one ``fork`` per worker.

Starting a worker from scratch spends about 1.5 s importing torch before it does anything; a launch after the first
one in a kernel (and every test after the first) skips that here. The controller (``control/workers/warm_parent.py``) talks to
this process over a Unix socket: each request is one JSON line with the worker's arguments, environment and
directory, and two file descriptors passed along (the worker's log file, and the read end of the controller's
lifeline pipe that tells a worker its controller died). The answer is the child's pid; when a child ends, its exit
status follows as ``{"exit": pid, "code": rc}`` (negative: killed by that signal, as ``Popen.returncode`` says).

The zygote ends when the controller closes the socket (or dies). It does nothing but fork and reap: a worker killed
by a signal must be reported within the failure monitor's half second of evidence (an idle-time preload of
transformers here once delayed that by 2 s, and the monitor named the killed stage "stuck"). Nothing here runs a
torch operation or starts a thread before forking, so each child starts as clean as a fresh interpreter: it leads
its own session, takes the request's environment and directory, and runs ``runtime/process.py``'s ``main`` as
``python -m`` would.
"""

from __future__ import annotations

import array
import gc
import importlib
import json
import logging
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any

# torch.optim's Optimizer.__init__ imports torch._dynamo on first use (its @_disable_dynamo wrapper): 2.5 s of imports
# that every forked worker would repeat when it builds its optimizer. Imported here, the fork shares it.
import torch._dynamo  # noqa: F401

from vpipe_lab.runtime import process  # the point of this process: torch and the runtime, imported before any fork
from vpipe_lab.runtime.model import compat

log = logging.getLogger(__name__)


def _child(request: dict[str, Any], log_fd: int, parent_fd: int, sock: socket.socket) -> None:
    """In the forked child: become the worker ``request`` describes. Never returns."""
    code = 1
    try:
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()  # its own session: the kernel's SIGINT does not reach it, killpg reaches what it starts
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null)
        os.close(log_fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # what `python -m` puts first: the user's modules in that directory import
        argv = [*request["argv"], "--parent-fd", str(parent_fd)]
        sys.argv = ["-m", *argv]
        code = process.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    process.exit_now(code)


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One request line and the descriptors that came with it; None when the controller is gone."""
    fds = array.array("i")
    data, ancillary, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(2 * fds.itemsize))
    if not data:
        return None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def serve(sock: socket.socket) -> None:
    """Fork a worker per request until the controller closes the socket; report every child's exit."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd hears about exits
    children: set[int] = set()
    sock.send(json.dumps({"ready": True}).encode())  # imports done: a close from here on is answered by leaving
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 512)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                sock.send(json.dumps({"exit": pid, "code": code}).encode())
        if sock in ready:
            got = _receive(sock)
            if got is None:
                return
            request, fds = got
            log_fd, parent_fd = fds
            pid = os.fork()
            if pid == 0:
                os.close(wake_r)
                os.close(wake_w)
                _child(request, log_fd, parent_fd, sock)
            os.close(log_fd)
            os.close(parent_fd)
            children.add(pid)
            sock.send(json.dumps({"pid": pid}).encode())


def preload(names: str) -> None:
    """Import the modules ``VPIPE_LAB_PRELOAD`` names (comma-separated, e.g. ``transformers``) before the first fork,
    so every worker of a HuggingFace model skips their import (~1.2 s each on a 2-core CPU). Done before serving, not
    while idle: a busy zygote would report a killed worker late. A module that fails to import is left to the
    workers, which then report it with their stage."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if wanted:  # nothing asked, nothing added to the start
        compat.allow_torchvision_without_ops()  # what a worker does before importing a model's libraries
    for name in wanted:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the worker that needs it will say why, with its stage
            log.warning("could not preload %r: %s", name, exc)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    preload(os.environ.get("VPIPE_LAB_PRELOAD", ""))
    # What every worker inherits (torch, the runtime: ~286,000 objects) is never garbage. Frozen, a worker's full
    # collections skip it (80 ms -> ~0 ms for these, runtime/heap.py collects every minute) and leave its pages shared
    # with the zygote instead of writing the collector's marks into them.
    gc.collect()
    gc.freeze()
    try:
        serve(sock)
    except (BrokenPipeError, ConnectionResetError):  # the controller is gone: so is the reason to be here
        pass
    process.exit_now(0)


if __name__ == "__main__":
    main()
