import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from vpipe_lab.cli.jobs import add_worker_arguments
from vpipe_lab.core.settings import Settings
from vpipe_lab.runtime.model.callables import load_callables
from vpipe_lab.runtime.torchrun import _env, _key, _roles, job_settings
from vpipe_lab.wire.jobspec import JobSpec


def spec() -> JobSpec:
    return JobSpec(session_id="s", key="k", address="tcp://x", master_addr="h", master_port=1,
                   settings=Settings(stages=2, microbatches=2))


def roles(**given: str | None) -> argparse.Namespace:
    return argparse.Namespace(**{r: given.get(r) for r in ("model", "data", "loss", "optimizer", "lr_scheduler",
                                                          "eval_data")})


def test_roles_are_bundled_names_or_importable_paths() -> None:
    s = spec()
    s.examples, s.imports = _roles(roles(model="mlp", data="vpipe_lab.examples.gpt:data"))
    assert s.examples == {"model": "mlp"} and s.imports == {"data": "vpipe_lab.examples.gpt:data"}
    fns = load_callables(s)
    assert fns.data.__module__ == "vpipe_lab.examples.gpt" and fns.loss.__module__ == "vpipe_lab.examples.mlp"
    with pytest.raises(ValueError, match=r"--lr-scheduler 'resnet'.*package\.module:attribute"):
        _roles(roles(model="mlp", lr_scheduler="resnet"))
    bad = spec()
    bad.examples, bad.imports = _roles(roles(model="vpipe_lab.examples.gpt:nothing"))
    with pytest.raises(ValueError, match="importable on every node"):
        load_callables(bad)


def test_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = argparse.Namespace(key=None, key_file=str(tmp_path / "k"))
    monkeypatch.delenv("VPIPE_LAB_KEY", raising=False)
    assert _key(args, 1) == ""  # other ranks never make one: they get rank 0's over the process group
    made = _key(args, 0)
    assert len(made) == 64 and (tmp_path / "k").stat().st_mode & 0o777 == 0o600 and _key(args, 0) == made
    monkeypatch.setenv("VPIPE_LAB_KEY", "from-env")
    assert _key(args, 0) == "from-env"



def test_a_key_on_the_command_line_is_refused_before_anything_starts() -> None:
    """Every user of the machine reads a process's command line (ps): the key goes in the environment or a file."""
    from vpipe_lab.cli.main import build_parser

    args = build_parser().parse_args(["worker", "--model", "mlp", "--key", "secret"])
    with pytest.raises(ValueError, match=r"--key puts the session key in this process's command line.*VPIPE_LAB_KEY"):
        job_settings(args)


def test_outside_torchrun_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="run `vpipe-lab worker` under torchrun"):
        _env("RANK")


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Settings]:
    """A worker's settings as torchrun's 2 processes would read them, before joining anything."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return lambda *argv: job_settings(parser.parse_args(["--model", "mlp", *argv]))


def test_pipedream_with_what_needs_one_step_of_the_whole_model_is_refused_before_joining(
        worker: Callable[..., Settings]) -> None:
    worker("--schedule", "pipedream")  # on its own it runs
    for extra, match in ((["--clip-grad-norm", "1.0"], "clip_grad_norm=1.0"), (["--precision", "fp16"], "fp16")):
        with pytest.raises(ValueError, match=match):
            worker("--schedule", "pipedream", *extra)
    worker("--clip-grad-norm", "1.0")  # a synchronous schedule clips


def test_every_schedule_launch_takes_runs_under_torchrun_with_launchs_chunks_or_is_refused_before_joining(
        worker: Callable[..., Settings]) -> None:
    """`--schedule zbv` was accepted and then failed on the workers after the rendezvous; interleaved-1f1b ran with
    one chunk where launch() uses two."""
    from vpipe_lab.core import schedules
    from vpipe_lab.core.plan import default_virtual_stages

    for name in schedules.names():
        assert worker("--schedule", name, "-m", "8").virtual_stages == default_virtual_stages(name), name
    assert worker("--schedule", "interleaved-1f1b", "--virtual-stages", "3", "-m", "8").virtual_stages == 3
    with pytest.raises(ValueError, match="zbv"):
        worker("--schedule", "zbv", "--virtual-stages", "3")
    with pytest.raises(ValueError, match="replicas=3 does not divide the 2 ranks"):
        worker("--replicas", "3")


def test_snapshots_go_in_the_run_directory_unless_turned_off_and_bad_values_are_refused(
        tmp_path: Path, worker: Callable[..., Settings]) -> None:
    from vpipe_lab.runtime.torchrun import _snapshots

    assert _snapshots(worker("--run-dir", str(tmp_path)), tmp_path) == str(tmp_path / "snapshots")  # K chosen by cost
    assert worker("--snapshot-every", "3", "--run-dir", str(tmp_path)).snapshot_every == 3
    assert _snapshots(worker("--snapshot-every", "0", "--run-dir", str(tmp_path)), tmp_path) is None
    assert _snapshots(worker(), None) is None
    for argv, match in ((["--snapshot-every", "-1"], "snapshot_every must be a whole number >= 0"),
                        (["--snapshot-every", "2"], "--run-dir"),
                        (["--snapshot-every", "2", "--run-dir", "r", "--engine", "torch"], "needs engine='lab'")):
        with pytest.raises(ValueError, match=match):
            worker(*argv)


def test_a_restart_resumes_from_the_newest_of_its_snapshots_and_checkpoints(tmp_path: Path) -> None:
    from vpipe_lab.core.plan import Plan
    from vpipe_lab.runtime.torchrun import _resume_point
    from vpipe_lab.wire import snapshot_format
    from vpipe_lab.wire.snapshot_format import SnapshotMeta

    snaps = tmp_path / "snapshots"
    assert _resume_point(tmp_path, 2, str(snaps)) is None  # a first start
    plan = Plan.from_counts([5, 5], 4)

    def take(iteration: int, stages_done: int, model_version: int = 0) -> None:
        key = (iteration, 0, model_version)
        where = snapshot_format.directory(snaps, key)
        where.mkdir(parents=True)
        SnapshotMeta(iteration, plan.to_dict(), 0, model_version).write(where)
        for stage in range(stages_done):
            snapshot_format.mark_done(snaps, key, stage)

    take(6, 2)
    take(9, 1)  # stage 1 had not written its part: not complete
    found = _resume_point(tmp_path, 2, str(snaps))
    assert found is not None and found["snapshot"].endswith(snapshot_format.directory(snaps, (6, 0, 0)).name)
    assert found["iteration"] == 6 and found["note"] == "resumed from the snapshot of iteration 6" and "path" not in found
    shrunk = _resume_point(tmp_path, 1, str(snaps))  # a node left: the same layers on one stage
    assert shrunk is not None and Plan.from_dict(shrunk["plan"]).stages == 1
    assert "torchrun started 1 stage(s) where the snapshot of iteration 6 was taken on 2" in shrunk["note"]
    take(12, 2, model_version=1)  # after set_model a restarted worker cannot rebuild the model: not from that one
    assert _resume_point(tmp_path, 2, str(snaps)) is None
