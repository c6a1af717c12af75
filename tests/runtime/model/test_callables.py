from pathlib import Path

import cloudpickle
import pytest

from vpipe_lab.core.settings import Settings
from vpipe_lab.runtime.model.callables import load_callables
from vpipe_lab.wire.jobspec import JobSpec


def spec(tmp_path: Path, **kw: object) -> JobSpec:
    return JobSpec(session_id="s", key="k", address="tcp://x", master_addr="h", master_port=1,
                   settings=Settings(stages=2, microbatches=2), **kw)  # type: ignore[arg-type]


def test_bundled_and_user_callables(tmp_path: Path) -> None:
    s = spec(tmp_path, examples={"model": "mlp", "data": "mlp"})
    fns = load_callables(s)
    assert fns.model.__name__ == "model" and fns.loss.__module__ == "vpipe_lab.examples.mlp"  # a bundled model
    # brings its own loss and optimizer unless they are given
    path = tmp_path / "c.pkl"
    path.write_bytes(cloudpickle.dumps({"loss": lambda a, b: 0}))
    s = spec(tmp_path, examples={"model": "mlp", "data": "mlp"}, callables_path=str(path))
    assert load_callables(s).loss(1, 2) == 0
    s.save(tmp_path / "job.json")
    assert JobSpec.load(tmp_path / "job.json") == s
    assert oct((tmp_path / "job.json").stat().st_mode & 0o777) == "0o600"


def test_missing_model_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no model or no data"):
        load_callables(spec(tmp_path))


def test_a_worker_unpickles_a_file_only_inside_its_job_directory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A command's ``file:`` reference (set_model, evaluation data, schedules) is code when unpickled: a worker
    reads only what its controller wrote into the job directory; the command line's own ``file:PATH`` is the user's."""
    import cloudpickle
    import pytest

    from vpipe_lab.runtime.model.callables import load_data

    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    job.mkdir()
    elsewhere.mkdir()
    for folder in (job, elsewhere):
        (folder / "data.pkl").write_bytes(cloudpickle.dumps([1, 2]))
    assert load_data(f"file:{job / 'data.pkl'}", job.resolve()) == [1, 2]
    for ref in (f"file:{elsewhere / 'data.pkl'}", f"file:{job}/../elsewhere/data.pkl"):
        with pytest.raises(ValueError, match="outside this job's directory"):
            load_data(ref, job.resolve())
    with pytest.raises(ValueError, match="outside this job's directory"):
        load_data(f"file:{job / 'data.pkl'}", None)  # a job without a directory (torchrun) unpickles nothing
    assert load_data(f"file:{elsewhere / 'data.pkl'}", named_by_user=True) == [1, 2]
