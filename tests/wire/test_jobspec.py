"""The job spec: its JSON round trip, and the training options every entry point shares."""

import argparse
from pathlib import Path

import pytest

from vpipe_lab.wire.jobspec import DEVICES, PRECISIONS, JobSpec, add_training_options, check_training


def test_round_trip_is_private(tmp_path: Path) -> None:
    spec = JobSpec(session_id="s", key="k" * 64, address="tcp://127.0.0.1:1", master_addr="127.0.0.1", master_port=2,
                   stages=2, microbatches=4, precision="bf16", clip_grad_norm=1.0)
    path = tmp_path / "job.json"
    spec.save(path)
    assert JobSpec.load(path) == spec
    assert path.stat().st_mode & 0o077 == 0  # it holds the session key


@pytest.mark.parametrize(("args", "match"), [
    ((0, "fp32", None, 1), "clip_grad_norm must be a positive number"),
    ((True, "fp32", None, 1), "clip_grad_norm"),
    ((None, "fp8", None, 1), "unknown precision 'fp8'"),
    ((None, "fp32", 0, 1), "eval_every must be a whole number"),
    ((None, "fp32", None, 1.5), "eval_batches"),
])
def test_bad_training_options_are_named(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_training(*args)  # type: ignore[arg-type]


def test_the_flags_are_the_same_everywhere() -> None:
    parser = argparse.ArgumentParser()
    add_training_options(parser, "package.module:attr")
    args = parser.parse_args(["--precision", "bf16", "--clip-grad-norm", "0.5", "--eval-every", "3"])
    assert (args.precision, args.clip_grad_norm, args.eval_every, args.eval_batches) == ("bf16", 0.5, 3, 1)
    check_training(args.clip_grad_norm, args.precision, args.eval_every, args.eval_batches)
    assert "fp16" in PRECISIONS and "cuda" in DEVICES
    with pytest.raises(SystemExit):
        parser.parse_args(["--precision", "fp8"])


def test_what_a_nonfinite_loss_does_is_a_flag_of_every_door_with_one_check() -> None:
    """launch(nonfinite=...), %vpipe start, vpipe-lab run and vpipe-lab worker: the same choices, default "pause"."""
    from vpipe_lab.cli.main import build_parser as cli
    from vpipe_lab.jupyter.magics import build_parser as magics
    from vpipe_lab.wire.jobspec import NONFINITE, check_nonfinite

    lines = {"worker": ["worker", "--model", "mlp"], "run": ["run"], "start": ["start", "mlp"]}
    for door, words in lines.items():
        parser = magics() if door == "start" else cli()
        assert parser.parse_args(words).nonfinite == "pause" == JobSpec.nonfinite
        assert parser.parse_args([*words, "--nonfinite", "skip"]).nonfinite == "skip"
    assert NONFINITE == ("pause", "skip", "continue")
    with pytest.raises(ValueError, match="unknown nonfinite 'nan': use one of pause, skip, continue"):
        check_nonfinite("nan")
