from pathlib import Path

import cloudpickle
import pytest

from vpipe_lab.runtime.model.callables import load_callables
from vpipe_lab.wire.jobspec import JobSpec


def spec(tmp_path: Path, **kw: object) -> JobSpec:
    return JobSpec(session_id="s", key="k", address="tcp://x", master_addr="h", master_port=1, stages=2,
                   microbatches=2, **kw)  # type: ignore[arg-type]


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
