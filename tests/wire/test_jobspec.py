"""The job file: its JSON round trip, private, with the job's settings inside."""

from pathlib import Path

from vpipe_lab.core.settings import Settings
from vpipe_lab.wire.jobspec import JobSpec


def test_round_trip_is_private_and_keeps_every_setting(tmp_path: Path) -> None:
    settings = Settings(stages=2, microbatches=4, precision="bf16", clip_grad_norm=1.0, memory_budget=(1 << 30, 2 << 30),
                        schedule="zbv", virtual_stages=2, auto_replan={"every": 5}, log="tensorboard:runs")
    spec = JobSpec(session_id="s", key="k" * 64, address="tcp://127.0.0.1:1", master_addr="127.0.0.1", master_port=2,
                   settings=settings)
    path = tmp_path / "job.json"
    spec.save(path)
    assert JobSpec.load(path) == spec
    assert path.stat().st_mode & 0o077 == 0  # it holds the session key


def test_a_logging_function_stays_with_the_controller(tmp_path: Path) -> None:
    spec = JobSpec(session_id="s", key="k", address="tcp://127.0.0.1:1", master_addr="127.0.0.1", master_port=2,
                   settings=Settings(log=print))
    spec.save(tmp_path / "job.json")
    assert JobSpec.load(tmp_path / "job.json").settings.log is None
