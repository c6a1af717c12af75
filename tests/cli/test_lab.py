"""`vpipe-lab lab`: a working copy of the tutorials, made once and never overwritten, and a real JupyterLab serving it
from any directory, for an editable install and for a wheel."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.integration.lab import free_port
from vpipe_lab.cli.lab import QUICKSTART, jupyter_command, shipped_tutorials, working_copy

ROOT = Path(__file__).resolve().parents[2]


def test_the_working_copy_is_made_once_and_never_overwritten(tmp_path: Path) -> None:
    source = shipped_tutorials()
    assert source == ROOT / "notebooks"  # this checkout's (an editable install)
    folder, copied = working_copy(tmp_path / "mine", source)
    assert QUICKSTART in copied and len(copied) == len(list(source.glob("*.ipynb"))) >= 6
    (folder / QUICKSTART).write_text("my edits")
    (folder / "02_tuning_the_partition.ipynb").unlink()
    _, again = working_copy(folder, source)
    assert again == ["02_tuning_the_partition.ipynb"]  # what was missing comes back; what was edited stays
    assert (folder / QUICKSTART).read_text() == "my edits"
    assert not list(folder.glob("*.py")) and not list(folder.glob("*.cfg"))  # tutorials only, not the test harness
    with pytest.raises(ValueError, match="give --dir a folder of your own"):
        working_copy(source, source)


def test_a_wheel_keeps_its_tutorials_inside_the_package(tmp_path: Path) -> None:
    package = tmp_path / "site" / "vpipe_lab"
    (package / "_notebooks").mkdir(parents=True)
    (package / "_notebooks" / QUICKSTART).write_text("{}")
    assert shipped_tutorials(package) == package / "_notebooks"
    with pytest.raises(FileNotFoundError, match="has no tutorials"):
        shipped_tutorials(tmp_path / "elsewhere" / "vpipe_lab")


def test_options_and_extra_arguments_go_to_jupyter(tmp_path: Path) -> None:
    args = argparse.Namespace(port=9123, token=None, no_token=True, no_browser=True,
                              jupyter_args=["--", "--ServerApp.ip=0.0.0.0"])
    command = jupyter_command(tmp_path, args)
    assert command[1:4] == ["-m", "jupyter", "lab"] and command[4] == str(tmp_path / QUICKSTART)
    assert f"--ServerApp.root_dir={tmp_path}" in command and "--ServerApp.port=9123" in command
    assert "--IdentityProvider.token=" in command and "--no-browser" in command
    assert command[-1] == "--ServerApp.ip=0.0.0.0" and "--" not in command
    defaults = jupyter_command(tmp_path, argparse.Namespace(port=None, token=None, no_browser=False, jupyter_args=[]))
    assert not any(a.startswith(("--ServerApp.port", "--IdentityProvider")) for a in defaults)


def test_a_token_on_the_command_line_is_refused_in_one_line_and_nothing_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/security.md: the lab's token never reaches an argv (ours refuses it, as --key is refused)."""
    from vpipe_lab.cli import main

    assert main(["lab", "--dir", str(tmp_path / "t"), "--token", "T0PSECRET", "--no-browser"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "JUPYTER_TOKEN" in err and "--token-file" in err
    assert not (tmp_path / "t").exists()  # refused before the tutorials were copied or a server started
    assert main(["lab", "--dir", str(tmp_path / "t"), "--", "--IdentityProvider.token=T0PSECRET"]) == 2
    assert "after -- puts the token on Jupyter's command line" in capsys.readouterr().err
    loose = tmp_path / "token"
    loose.write_text("T0PSECRET\n")
    loose.chmod(0o644)
    assert main(["lab", "--dir", str(tmp_path / "t"), "--token-file", str(loose)]) == 2
    assert "chmod 600" in capsys.readouterr().err and not (tmp_path / "t").exists()


@pytest.mark.slow
def test_the_token_file_reaches_jupyter_in_its_environment_and_no_argv_shows_it(tmp_path: Path) -> None:
    """`ps` shows no token; the API refuses a request without it and serves one with it."""
    import psutil

    secret = "s3cret-" + os.urandom(8).hex()
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    token_file.chmod(0o600)
    port = free_port()
    entry = Path(sys.executable).parent / "vpipe-lab"
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_TOKEN"} | {"HOME": str(tmp_path)}
    log = (tmp_path / "lab.log").open("wb")
    proc = subprocess.Popen([str(entry), "lab", "--no-browser", "--port", str(port), "--token-file", str(token_file)],
                            cwd=tmp_path, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        url = f"http://127.0.0.1:{port}/api/kernels"
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"token {secret}"}),
                                       timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "lab.log").read_text()[-2000:]
                time.sleep(0.5)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=5)
        assert refused.value.code == 403
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert len(family) >= 2
        for member in family:
            assert secret not in " ".join(member.cmdline()), member.cmdline()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_and_list(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> list[str]:
    """Start ``vpipe-lab lab`` as a user would, wait for its server, list what it serves, stop it."""
    port = free_port()
    proc = subprocess.Popen([*command, "--no-browser", "--port", str(port)], cwd=cwd, env={**env, "JUPYTER_TOKEN": "secret"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/api/contents",
                                                 headers={"Authorization": "token secret"})
                listing = json.load(urllib.request.urlopen(request, timeout=2))
                return sorted(item["name"] for item in listing["content"])
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read().decode() if proc.stdout else ""  # type: ignore[union-attr]
                    raise AssertionError(f"vpipe-lab lab did not serve (exit {proc.poll()}):\n{out[-3000:]}") from None
                time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_from_any_directory_with_the_editable_install(tmp_path: Path) -> None:
    entry = Path(sys.executable).parent / "vpipe-lab"
    listing = serve_and_list([str(entry), "lab"], tmp_path, {**os.environ, "HOME": str(tmp_path)})
    assert QUICKSTART in listing and len(listing) >= 6
    assert (tmp_path / "vpipe-lab-tutorials" / QUICKSTART).exists()  # served from the user's copy, in their cwd


@pytest.mark.slow
def test_from_any_directory_with_a_wheel(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp_path / "dist")],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("vpipe_lab-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert f"vpipe_lab/_notebooks/{QUICKSTART}" in names
    assert {"vpipe_lab/jupyter/static/live.js", "vpipe_lab/jupyter/static/plotly.js.gz",
            "vpipe_lab/jupyter/static/partition.js"} <= set(names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import vpipe_lab; print(vpipe_lab.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site))  # the wheel's package, not this checkout
    work = tmp_path / "somewhere"
    work.mkdir()
    listing = serve_and_list([sys.executable, "-m", "vpipe_lab.cli", "lab"], work, env)
    assert QUICKSTART in listing and (work / "vpipe-lab-tutorials" / QUICKSTART).exists()
    assert not list((site / "vpipe_lab" / "_notebooks").glob(".ipynb_checkpoints"))  # the package is not opened


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_stops_the_server_and_its_kernel_too(sig: signal.Signals, tmp_path: Path) -> None:
    """A service manager's SIGTERM, Ctrl+C's SIGINT, a closed terminal's SIGHUP: nothing stays serving the port."""
    import psutil

    port = free_port()
    entry = Path(sys.executable).parent / "vpipe-lab"
    log = (tmp_path / "lab.log").open("wb")  # a file, not a pipe: Jupyter's log must never block on a full pipe
    proc = subprocess.Popen([str(entry), "lab", "--no-browser", "--port", str(port)],
                            cwd=tmp_path, env={**os.environ, "HOME": str(tmp_path), "JUPYTER_TOKEN": "secret"},
                            stdout=log, stderr=log,
                            start_new_session=True)
    family: list[psutil.Process] = []
    try:
        headers = {"Authorization": "token secret"}
        deadline = time.monotonic() + 120
        while True:  # the server answers
            try:
                urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/api", headers=headers),
                                       timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "vpipe-lab lab did not serve"
                time.sleep(0.5)
        started = urllib.request.Request(f"http://127.0.0.1:{port}/api/kernels", data=b"{}", headers=headers,
                                         method="POST")
        kernel = json.load(urllib.request.urlopen(started, timeout=30))["id"]
        while time.monotonic() < deadline:  # the kernel's process is up (a child of the server)
            family = psutil.Process(proc.pid).children(recursive=True)
            if len(family) >= 2:
                break
            time.sleep(0.2)
        assert len(family) >= 2, f"no kernel process for kernel {kernel}"
        proc.send_signal(sig)
        assert proc.wait(timeout=40) == 128 + sig
        _, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, f"left running after {sig.name}: {[p.pid for p in alive]}"
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api", timeout=2)
        said = (tmp_path / "lab.log").read_text()
        assert "stopped the Jupyter server" in said
        # Jupyter had its grace period and shut its kernel down itself (it was killed 45 ms after SIGTERM)
        assert "did not stop within" not in said and "Shutting down 1 kernel" in said, said[-2000:]
    finally:
        for p in [*family, psutil.Process(proc.pid)] if proc.poll() is None else family:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=10)
        log.close()
