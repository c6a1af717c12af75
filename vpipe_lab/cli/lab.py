"""`vpipe-lab lab`: JupyterLab on a working copy of the tutorials, from any directory and any kind of install.

The tutorials ship inside the wheel (``vpipe_lab/_notebooks``) and sit in a source checkout's ``notebooks/``; neither
is ever opened in place (running and saving a tutorial would edit the package or the repository). The first run
copies them into ``./vpipe-lab-tutorials/`` (or ``--dir``); later runs use that copy as the user left it and only add
tutorials it lacks, never overwriting one. The command owns its Jupyter server: stopping it (SIGTERM, SIGINT,
SIGHUP) stops the server and its kernels too (``serve``).

The server's token never goes on a command line (every local user reads those with ``ps``): it comes from
``$JUPYTER_TOKEN`` (inherited) or an owner-only ``--token-file``, and reaches Jupyter in its environment, which only
its owner can read (``/proc/PID/environ`` is mode 0400).
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

from vpipe_lab.wire.private import read_key

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


TOKEN_ON_ARGV = ("--token puts the server's token on this command line, which every user of the machine can read (ps, "
                 "/proc/PID/cmdline): export JUPYTER_TOKEN=... or give --token-file FILE (mode 0600)")


def jupyter_command(folder: Path, args: argparse.Namespace) -> list[str]:
    """The server's command line: nothing secret on it (``jupyter_env`` carries the token)."""
    command = [sys.executable, "-m", "jupyter", "lab", str(folder / QUICKSTART), f"--ServerApp.root_dir={folder}"]
    if args.port is not None:
        command.append(f"--ServerApp.port={args.port}")
    if getattr(args, "no_token", False):
        command.append("--IdentityProvider.token=")  # an empty token is no secret: authentication off, as asked
    if args.no_browser:
        command.append("--no-browser")
    if os.geteuid() == 0 and "--allow-root" not in args.jupyter_args:
        command.append("--allow-root")  # JupyterLab refuses root without it (containers often run as root)
    extra = list(args.jupyter_args)
    return command + (extra[1:] if extra[:1] == ["--"] else extra)


def jupyter_env(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours, with ``JUPYTER_TOKEN`` from ``--token-file`` when one is given (refused
    unless only its owner can read it, as a session key file is)."""
    env = dict(os.environ if environ is None else environ)
    if getattr(args, "token", None) is not None:
        raise ValueError(TOKEN_ON_ARGV)
    for arg in getattr(args, "jupyter_args", []):
        option, _, value = arg.partition("=")
        if option.endswith(".token") and value:  # --IdentityProvider.token=T (or ServerApp's, NotebookApp's) after --
            raise ValueError(f"{option}=... after -- puts the token on Jupyter's command line, which every user of the "
                             "machine can read: export JUPYTER_TOKEN=... or give --token-file FILE (mode 0600)")
    if getattr(args, "token_file", None):
        token = read_key(args.token_file)  # owner-only, or refused with the chmod that fixes it
        if not token:
            raise ValueError(f"token file {args.token_file} is empty: write a token into it, or pass --no-token to "
                             "serve without one (a trusted machine only)")
        env["JUPYTER_TOKEN"] = token
        env.pop("JUPYTER_TOKEN_FILE", None)
    return env


def cmd_lab(args: argparse.Namespace) -> int:
    """Open JupyterLab on the quickstart tutorial, in a working copy of the tutorials."""
    env = jupyter_env(args)  # a refused token ends here, before anything is copied or started
    folder, copied = working_copy(Path(args.dir))
    if copied:
        print(f"vpipe-lab: copied {len(copied)} tutorial(s) into {folder}/ (yours to edit; never overwritten)",
              file=sys.stderr)
    else:
        print(f"vpipe-lab: using your tutorials in {folder}/", file=sys.stderr)
    command = jupyter_command(folder, args)
    print("vpipe-lab: starting:", " ".join(command), file=sys.stderr)
    return serve(command, env=env)


STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 15.0  # Jupyter's own shutdown (its kernels and terminals) before the server's process group is killed


def serve(command: list[str], grace_s: float = GRACE_S, env: dict[str, str] | None = None) -> int:
    """Run the Jupyter server and own it: SIGTERM (a service manager), SIGINT (Ctrl+C) or SIGHUP (a closed terminal)
    to this process shuts the server down with its kernels, instead of leaving it serving, reparented to init.

    The server runs in a session of its own, so a terminal's Ctrl+C reaches this process only (not Jupyter's
    "Shutdown this Jupyter server (y/[n])?" prompt); this process then asks the server to stop (SIGTERM: Jupyter shuts
    its kernels down and exits), waits ``grace_s``, and kills the server's process group if it is still there.
    Returns the server's exit code (128 + the signal's number when a signal stopped it, as a shell reports)."""
    server = subprocess.Popen(command, start_new_session=True, env=env)
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
    lab.add_argument("--token", help="refused: a token on the command line is in /proc/PID/cmdline, which every "
                     "user of the machine can read (ps); export JUPYTER_TOKEN or give --token-file")
    lab.add_argument("--token-file", help="read the server's token from this file (mode 0600); default: "
                     "$JUPYTER_TOKEN, else Jupyter makes one and prints its URL")
    lab.add_argument("--no-token", action="store_true", help="serve without a token (a trusted machine only)")
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser")
    lab.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="-- then options for jupyter lab")
    lab.set_defaults(func=cmd_lab)
