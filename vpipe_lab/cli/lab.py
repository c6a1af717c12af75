"""`vpipe-lab lab`: JupyterLab on a working copy of the tutorials, from any directory and any kind of install.

The tutorials ship inside the wheel (``vpipe_lab/_notebooks``) and sit in a source checkout's ``notebooks/``; neither
is ever opened in place (running and saving a tutorial would edit the package or the repository). The first run
copies them into ``./vpipe-lab-tutorials/`` (or ``--dir``); later runs use that copy as the user left it and only add
tutorials it lacks, never overwriting one. The command owns its Jupyter server: stopping it (SIGTERM, SIGINT,
SIGHUP) stops the server and its kernels too (``serve``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
PACKAGE = Path(__file__).resolve().parents[1]  # .../vpipe_lab
QUICKSTART = "01_quickstart.ipynb"


def shipped_tutorials(package: Path = PACKAGE) -> Path:
    """Where this install keeps the tutorials: inside a wheel's package, or beside the package in a source checkout
    (an editable install)."""
    candidates = [package / "_notebooks"]
    checkout = package.parent
    if (checkout / "pyproject.toml").exists() and 'name = "vpipe_lab"' in (checkout / "pyproject.toml").read_text():
        candidates.append(checkout / "notebooks")
    for candidate in candidates:
        if (candidate / QUICKSTART).exists():
            return candidate
    raise FileNotFoundError(f"this vpipe_lab install has no tutorials: looked in {', '.join(map(str, candidates))}; "
                            "reinstall it (pip install vpipe_lab) or run from a source checkout")


def working_copy(target: Path, source: Path | None = None) -> tuple[Path, list[str]]:
    """``target`` holding every tutorial: created on first use; a tutorial already there is left as the user left
    it. Returns the folder and the names copied now."""
    source = source if source is not None else shipped_tutorials()
    if target.resolve() == source.resolve():
        raise ValueError(f"{target} is where the tutorials ship: give --dir a folder of your own")
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for notebook in sorted(source.glob("*.ipynb")):
        if not (target / notebook.name).exists():
            shutil.copyfile(notebook, target / notebook.name)
            copied.append(notebook.name)
    return target, copied


def jupyter_command(folder: Path, args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "jupyter", "lab", str(folder / QUICKSTART), f"--ServerApp.root_dir={folder}"]
    if args.port is not None:
        command.append(f"--ServerApp.port={args.port}")
    if args.token is not None:
        command.append(f"--IdentityProvider.token={args.token}")
    if args.no_browser:
        command.append("--no-browser")
    if os.geteuid() == 0 and "--allow-root" not in args.jupyter_args:
        command.append("--allow-root")  # JupyterLab refuses root without it (containers often run as root)
    extra = list(args.jupyter_args)
    return command + (extra[1:] if extra[:1] == ["--"] else extra)


def cmd_lab(args: argparse.Namespace) -> int:
    """Open JupyterLab on the quickstart tutorial, in a working copy of the tutorials."""
    folder, copied = working_copy(Path(args.dir))
    if copied:
        print(f"vpipe-lab: copied {len(copied)} tutorial(s) into {folder}/ (yours to edit; never overwritten)",
              file=sys.stderr)
    else:
        print(f"vpipe-lab: using your tutorials in {folder}/", file=sys.stderr)
    command = jupyter_command(folder, args)
    print("vpipe-lab: starting:", " ".join(command), file=sys.stderr)
    return serve(command)


STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 15.0  # Jupyter's own shutdown (its kernels and terminals) before the server's process group is killed


def serve(command: list[str], grace_s: float = GRACE_S) -> int:
    """Run the Jupyter server and own it: SIGTERM (a service manager), SIGINT (Ctrl+C) or SIGHUP (a closed terminal)
    to this process shuts the server down with its kernels, instead of leaving it serving, reparented to init.

    The server runs in a session of its own, so a terminal's Ctrl+C reaches this process only (not Jupyter's
    "Shutdown this Jupyter server (y/[n])?" prompt); this process then asks the server to stop (SIGTERM: Jupyter shuts
    its kernels down and exits), waits ``grace_s``, and kills the server's process group if it is still there.
    Returns the server's exit code (128 + the signal's number when a signal stopped it, as a shell reports)."""
    server = subprocess.Popen(command, start_new_session=True)
    received: list[int] = []
    deadline = [math.inf]  # when the grace period of the first signal ends

    def stop(signum: int, frame: Any) -> None:
        received.append(signum)
        deadline[0] = min(deadline[0], time.monotonic() + grace_s)
        if server.poll() is None:
            log.info("signal %d: stopping the Jupyter server (pid %d)", signum, server.pid)
            server.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in STOPS}
    try:
        while True:
            try:
                # A short wait even after a signal: the signal lands inside a wait, which then runs out at its own
                # timeout, so the grace period is counted from the signal (it killed Jupyter 45 ms after SIGTERM).
                code = server.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if received and time.monotonic() >= deadline[0]:  # it did not shut down within the grace period
                    log.warning("the Jupyter server did not stop within %.0f s: killing it", grace_s)
                    _kill_group(server.pid)
                    code = server.wait()
                    break
    finally:
        if server.poll() is None:  # an error here: never leave the server behind
            _kill_group(server.pid)
            server.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        print(f"vpipe-lab: stopped the Jupyter server (signal {received[0]})", file=sys.stderr)
        return 128 + received[0]
    return code


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def add_command(sub: Any) -> None:
    lab = sub.add_parser("lab", help="open JupyterLab on the quickstart tutorial (a working copy of the tutorials)",
                         description="Open JupyterLab on the quickstart tutorial. The tutorials are copied into --dir "
                         "the first time (never overwritten later). Arguments after -- go to jupyter lab as they are, "
                         "e.g.: vpipe-lab lab --port 9000 -- --ServerApp.ip=0.0.0.0")
    lab.add_argument("--dir", default="vpipe-lab-tutorials",
                     help="your working copy of the tutorials (default: ./vpipe-lab-tutorials)")
    lab.add_argument("--port", type=int, help="the server's port (default: Jupyter's, 8888 or the next free one)")
    lab.add_argument("--token", help="the server's token (default: Jupyter makes one; '' for none, on a trusted "
                     "machine only)")
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser")
    lab.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="-- then options for jupyter lab")
    lab.set_defaults(func=cmd_lab)
