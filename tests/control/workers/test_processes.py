import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from vpipe_lab.control.workers.processes import Launcher, _alive, reap_stale, start_time, state_dir

SLEEPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)  # vpipe_lab"


def test_terminate_escalates_to_sigkill(tmp_path: Path) -> None:
    launcher = Launcher("t1", tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    from vpipe_lab.control.workers.processes import WorkerProcess

    launcher.workers.append(WorkerProcess(0, proc, tmp_path / "w.log"))
    time.sleep(0.5)
    start = time.monotonic()
    launcher.terminate(timeout=1.0)
    assert proc.poll() == -signal.SIGKILL and time.monotonic() - start < 5


def test_reap_stale_kills_workers_of_a_dead_controller(tmp_path: Path) -> None:
    victim = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner.wait()
    (state_dir() / "stale.json").write_text(json.dumps({"owner": dead_owner.pid, "pids": [victim.pid],
                                                        "procs": [[victim.pid, start_time(victim.pid)]]}))
    assert reap_stale() == 1
    victim.wait(timeout=5)
    assert not _alive(victim.pid) and not (state_dir() / "stale.json").exists()


def test_a_recorded_pid_now_held_by_another_process_is_left_alone(tmp_path: Path) -> None:
    """pids wrap: the registry's pid may be another session's worker (or anyone's process) by now. Only the process
    with the recorded start time is the one recorded; an older entry without start times proves nothing."""
    bystander = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner.wait()
    try:
        started = start_time(bystander.pid)
        assert started is not None and start_time(dead_owner.pid) is None
        for name, doc in (("reused", {"procs": [[bystander.pid, started - 1]]}), ("old", {"pids": [bystander.pid]})):
            (state_dir() / f"{name}.json").write_text(json.dumps({"owner": dead_owner.pid, **doc}))
            assert reap_stale() == 0
            assert bystander.poll() is None and not (state_dir() / f"{name}.json").exists()
    finally:
        bystander.kill()
        bystander.wait(5)


def test_registry_lists_live_workers(tmp_path: Path) -> None:
    launcher = Launcher("t3", tmp_path)
    entry = state_dir() / "t3.json"
    launcher._write_registry()
    assert json.loads(entry.read_text())["owner"] == os.getpid()
    launcher.terminate(timeout=0.1)
    assert not entry.exists()


def test_a_restart_ends_the_workers_and_keeps_the_launcher(tmp_path: Path) -> None:
    from vpipe_lab.control.workers.processes import WorkerProcess

    launcher = Launcher("t4", tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    (tmp_path / "worker-0.log").write_text("what the dead worker said")
    launcher.workers.append(WorkerProcess(0, proc, tmp_path / "worker-0.log"))
    launcher.end_workers(timeout=0.5)
    assert proc.poll() is not None and launcher.workers == [] and launcher.generation == 1
    assert (tmp_path / "worker-0.before-restart-1.log").read_text() == "what the dead worker said"
    assert json.loads((state_dir() / "t4.json").read_text())["pids"] == []  # still registered, for new workers
    launcher.terminate(timeout=0.5)
    try:  # a restart that comes after stop() starts nothing
        launcher.start_rank(0, tmp_path / "job.json")
        raise AssertionError("spawned after terminate")
    except RuntimeError as exc:
        assert "were stopped" in str(exc)


def test_a_dead_sessions_job_directory_and_its_key_go_with_its_workers(tmp_path: Path) -> None:
    """A kernel that died left job.json (the job's key) in the temp directory: the next launch's reap removes it, and
    only a directory launch() made: a registry naming anything else removes nothing."""
    import tempfile

    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner.wait()
    job = Path(tempfile.mkdtemp(prefix="vpipe-lab-"))
    (job / "job.json").write_text('{"key": "secret"}')
    precious = tmp_path / "vpipe-lab-mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep")
    for name, where in (("dead", job), ("elsewhere", precious), ("odd", 3)):
        (state_dir() / f"{name}.json").write_text(json.dumps({"owner": dead_owner.pid, "procs": [],
                                                             "job_dir": str(where) if name != "odd" else where}))
    reap_stale()
    assert not job.exists() and (precious / "notes.txt").read_text() == "keep"
    assert not list(state_dir().glob("dead.json")) and not list(state_dir().glob("elsewhere.json"))


def test_a_job_directory_ends_with_its_session_but_a_failures_checkpoint_and_the_logs(tmp_path: Path) -> None:
    """terminate() (stop, a failure, the interpreter's exit) takes the job directory, job.json's key and the pickled
    callables with it; where the failure's error says to resume from a checkpoint inside it, that stays, with the
    workers' logs, and it is remembered for the call at exit."""
    def job(name: str) -> Path:
        where = tmp_path / name
        (where / "checkpoints" / "plan-v2").mkdir(parents=True)
        (where / "checkpoints" / "plan-v2" / "LATEST").write_text("v1")
        for file in ("job.json", "callables.pkl", "worker-0.log", "model-v1.pkl"):
            (where / file).write_text(file)
        return where

    plain = job("plain")
    Launcher("t5", plain).terminate(timeout=0.1)
    assert not plain.exists()

    failed = job("failed")
    launcher = Launcher("t6", failed)
    launcher.terminate(timeout=0.1, keep=str(failed / "checkpoints" / "plan-v2"))
    launcher.terminate(timeout=0.1)  # again at exit: the checkpoint is still kept
    assert sorted(p.name for p in failed.iterdir()) == ["checkpoints", "worker-0.log"]
    assert (failed / "checkpoints" / "plan-v2" / "LATEST").read_text() == "v1"

    elsewhere = job("elsewhere")  # a checkpoint the user saved outside keeps nothing here
    Launcher("t7", elsewhere).terminate(timeout=0.1, keep=str(tmp_path / "mine"))
    assert not elsewhere.exists()
