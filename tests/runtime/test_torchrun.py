import argparse
from pathlib import Path

import pytest

from vpipe_lab.cli.jobs import add_worker_arguments
from vpipe_lab.runtime.model.callables import load_callables
from vpipe_lab.runtime.torchrun import _check, _env, _key, _role
from vpipe_lab.wire.jobspec import JobSpec


def spec() -> JobSpec:
    return JobSpec(session_id="s", key="k", address="tcp://x", master_addr="h", master_port=1, stages=2,
                   microbatches=2)


def test_roles_are_bundled_names_or_importable_paths() -> None:
    s = spec()
    _role("mlp", "model", s)
    _role("vpipe_lab.examples.gpt:data", "data", s)
    assert s.examples == {"model": "mlp"} and s.imports == {"data": "vpipe_lab.examples.gpt:data"}
    fns = load_callables(s)
    assert fns.data.__module__ == "vpipe_lab.examples.gpt" and fns.loss.__module__ == "vpipe_lab.examples.mlp"
    with pytest.raises(ValueError, match=r"package\.module:attribute"):
        _role("resnet", "model", spec())
    bad = spec()
    _role("vpipe_lab.examples.gpt:nothing", "model", bad)
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
    assert _key(argparse.Namespace(key="given", key_file=""), 0) == "given"


def test_outside_torchrun_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="run `vpipe-lab worker` under torchrun"):
        _env("RANK")


def test_pipedream_with_what_needs_one_step_of_the_whole_model_is_refused_before_joining() -> None:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    _check(parser.parse_args(["--model", "mlp", "--schedule", "pipedream"]))  # on its own it runs
    for extra, match in ((["--clip-grad-norm", "1.0"], "clip_grad_norm=1.0"), (["--precision", "fp16"], "fp16"),
                         (["--replicas", "2"], "replicas=2")):
        with pytest.raises(ValueError, match=f"--schedule pipedream: .*{match}"):
            _check(parser.parse_args(["--model", "mlp", "--schedule", "pipedream", *extra]))
    _check(parser.parse_args(["--model", "mlp", "--clip-grad-norm", "1.0"]))  # a synchronous schedule clips
