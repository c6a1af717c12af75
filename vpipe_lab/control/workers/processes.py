"""Starting, watching and stopping worker processes so that none outlives the process that started it.

Workers run in their own process session (so Jupyter's "Interrupt kernel" SIGINT does not reach them), inherit the
read end of a pipe whose write end only the controller holds (EOF tells them the controller died, even after a
SIGKILL), and are listed in an on-disk registry so a later launch can reap what a crashed controller left behind.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from vpipe_lab.control.workers import warm_parent
from vpipe_lab.control.workers.warm_parent import ForkedWorker

log = logging.getLogger(__name__)


def state_dir() -> Path:
    root = Path(os.environ.get("VPIPE_LAB_STATE_DIR", Path.home() / ".cache" / "vpipe_lab"))
    path = root / "sessions"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child counts as dead
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return True


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat's 22nd field), None if it is gone. pids
    wrap (at 32768 here): a pid with the start time recorded for it is the very process recorded."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # workers lead their own session, so this reaches anything they started too
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap_stale() -> int:
    """Kill workers of sessions whose controller is gone; returns how many processes were signalled."""
    killed = 0
    for entry in state_dir().glob("*.json"):
        try:
            doc = json.loads(entry.read_text())
        except (OSError, json.JSONDecodeError):
            entry.unlink(missing_ok=True)
            continue
        owner = int(doc.get("owner", 0))
        if _alive(owner) and start_time(owner) == doc.get("owner_start", start_time(owner)):
            continue
        # Only a process that is provably the one recorded (its pid and its start time) is signalled: a pid reused by
        # another session's worker, or anyone's process, is left alone. An entry of an older release, without start
        # times, proves nothing: it is dropped.
        for pid, started in doc.get("procs", []):
            if _alive(pid) and start_time(pid) == started:
                kill_group(pid, signal.SIGKILL)
                killed += 1
        _remove_job_dir(doc.get("job_dir"))  # its job.json holds the job's key
        entry.unlink(missing_ok=True)
    if killed:
        log.warning("reaped %d worker process(es) left by a controller that died", killed)
    return killed


JOB_DIR_PREFIX = "vpipe-lab-"  # launch()'s job directories: tempfile.mkdtemp(prefix=JOB_DIR_PREFIX)


def _remove_job_dir(path: object) -> None:
    """Remove a dead session's job directory: only one launch() made (a ``vpipe-lab-*`` directory of this user in
    the temp directory), whatever a registry file names, so an edited registry cannot aim this at other files."""
    if not isinstance(path, str):
        return
    target = Path(path)
    try:
        ours = (target.parent == Path(tempfile.gettempdir()) and target.name.startswith(JOB_DIR_PREFIX)
                and not target.is_symlink() and target.is_dir() and target.stat().st_uid == os.getuid())
    except OSError:
        return
    if ours:
        shutil.rmtree(target, ignore_errors=True)
        log.info("removed %s, the job directory of a session whose controller died", target)


def clear_job_dir(job_dir: Path, keep: str | None = None) -> None:
    """A session ended: its job directory goes (``job.json`` holds the job's key; the pickles, the user's code and
    data). Where a failure's recovery checkpoint lies inside it (``keep``, which the error tells the user to resume
    from), that checkpoint and the workers' logs stay, and nothing else."""
    inside = None
    if keep is not None:
        try:
            inside = Path(keep).resolve().relative_to(job_dir.resolve()).parts[0]
        except (ValueError, IndexError, OSError):
            inside = None
    if inside is None:
        shutil.rmtree(job_dir, ignore_errors=True)
        return
    try:
        entries = list(job_dir.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name == inside or (entry.name.startswith("worker-") and entry.suffix == ".log"):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    log.warning("kept %s (the failure's checkpoint) and the workers' logs in %s; remove it when done", keep, job_dir)


@dataclass
class WorkerProcess:
    rank: int
    popen: subprocess.Popen[bytes] | ForkedWorker
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


_LIVE: weakref.WeakSet[Launcher] = weakref.WeakSet()


class Launcher:
    """Owns one session's worker processes."""

    def __init__(self, session_id: str, job_dir: Path) -> None:
        self.session_id = session_id
        self.job_dir = job_dir
        self.workers: list[WorkerProcess] = []
        self._read_fd, self._write_fd = os.pipe()  # non-inheritable; the read end is passed explicitly
        self._registry = state_dir() / f"{session_id}.json"
        # A restart spawns from the monitor's thread while stop() may end everything from the user's: never both
        self._lock = threading.RLock()
        self._closed = False
        self.generation = 0  # restarts so far (end_workers)
        self._keep: str | None = None  # a failure's recovery checkpoint in the job directory, kept when it goes
        _LIVE.add(self)

    @property
    def parent_fd(self) -> int:
        return self._read_fd

    def spawn(self, rank: int, args: list[str], env: dict[str, str] | None = None) -> WorkerProcess:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the session's workers were stopped: worker {rank} is not started")
            return self._spawn(rank, args, env)

    def start_rank(self, rank: int, spec_path: Path) -> WorkerProcess:
        """Start worker ``rank`` of the job described by ``spec_path`` (``python -m vpipe_lab.runtime.process``)."""
        return self.spawn(rank, ["--config", str(spec_path), "--rank", str(rank)])

    def _spawn(self, rank: int, args: list[str], env: dict[str, str] | None) -> WorkerProcess:
        log_path = self.job_dir / f"worker-{rank}.log"
        env = {**os.environ, **(env or {})}
        with open(log_path, "wb") as out:
            popen: subprocess.Popen[bytes] | ForkedWorker | None = None
            if warm_parent.enabled():
                try:
                    popen = warm_parent.zygote().fork(args, out.fileno(), self._read_fd, env)
                except (OSError, RuntimeError) as exc:
                    log.warning("starting worker %d directly: %s", rank, exc)
            if popen is None:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "vpipe_lab.runtime.process", *args, "--parent-fd", str(self._read_fd)],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, pass_fds=(self._read_fd,), env=env,
                )
        worker = WorkerProcess(rank, popen, log_path)
        self.workers.append(worker)
        self._write_registry()
        return worker

    def _write_registry(self) -> None:
        doc = {"owner": os.getpid(), "owner_start": start_time(os.getpid()), "pids": [w.pid for w in self.workers],
               "procs": [[w.pid, start_time(w.pid)] for w in self.workers], "job_dir": str(self.job_dir),
               "created": time.time()}
        self._registry.write_text(json.dumps(doc))

    def exited(self) -> list[tuple[WorkerProcess, int]]:
        """Workers that have exited, with their return codes (negative: killed by that signal)."""
        return [(w, rc) for w in self.workers if (rc := w.popen.poll()) is not None]

    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.popen.poll() is None]

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.alive()

    def remaining(self) -> list[int]:
        """The workers and anything they started that still exist, zombies included (Linux: their process groups,
        read from /proc; elsewhere the workers alone)."""
        groups = {w.pid for w in self.workers}
        left = {w.pid for w in self.alive()}
        try:
            entries = os.listdir("/proc")
        except OSError:
            return sorted(left)
        for name in entries:
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()  # after the command: state, ppid, pgrp, ...
            except OSError:  # gone while we looked
                continue
            if int(fields[2]) in groups:
                left.add(int(name))
        return sorted(left)

    def terminate(self, timeout: float = 5.0, settle: float = 30.0, keep: str | None = None) -> None:
        """SIGTERM every worker, SIGKILL what is left after ``timeout``, then return only once every worker and
        everything it started has exited and been reaped (at most ``settle`` seconds more: a SIGKILLed process
        only waits for its parent to collect it, which a loaded machine delays); drop the registry entry and the job
        directory (but ``keep``, a failure's recovery checkpoint in it, remembered for a later call: the one at
        exit). The session is over: a job directory never outlives it."""
        with self._lock:
            self._closed = True
            self._keep = keep or self._keep
            self._end(timeout, settle)
            self.close_pipe()
            self._registry.unlink(missing_ok=True)
            clear_job_dir(self.job_dir, self._keep)

    def end_workers(self, timeout: float = 2.0, settle: float = 30.0) -> None:
        """End every worker as ``terminate`` does, but keep the launcher for new ones (a restart spawns them)."""
        with self._lock:
            self._end(timeout, settle)
            self.generation += 1
            for w in self.workers:  # the replacements write worker-R.log afresh: keep what the ended ones said
                try:
                    w.log_path.rename(w.log_path.with_name(f"worker-{w.rank}.before-restart-{self.generation}.log"))
                except OSError:
                    pass
            self.workers = []
            self._write_registry()

    def _end(self, timeout: float, settle: float) -> None:
        for w in self.alive():
            kill_group(w.pid, signal.SIGTERM)
        if not self.wait(timeout):
            for w in self.alive():
                log.warning("worker %d (pid %d) ignored SIGTERM for %.0f s; killing it", w.rank, w.pid, timeout)
                kill_group(w.pid, signal.SIGKILL)
            self.wait(timeout)
        for w in self.workers:
            kill_group(w.pid, signal.SIGKILL)  # anything the worker itself started dies with its group
        deadline = time.monotonic() + settle
        while (left := self.remaining()) and time.monotonic() < deadline:
            for pid in left:  # a straggler the group signal missed (it started after it)
                kill_group(pid, signal.SIGKILL)
            time.sleep(0.02)
        if left:
            log.warning("processes %s of this session's workers had not exited %.0f s after SIGKILL", left, settle)

    def close_pipe(self) -> None:
        for fd in (self._write_fd, self._read_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._write_fd = self._read_fd = -1


@atexit.register
def _terminate_all() -> None:
    for launcher in list(_LIVE):
        try:
            launcher.terminate(timeout=2.0)
        except Exception:  # at interpreter exit, keep going to the next one
            log.exception("could not stop the workers of session %s", launcher.session_id)
