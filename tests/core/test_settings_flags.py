"""The flags derived from the settings' fields: names, switches, sizes, choices listed but checked by the settings."""

import argparse

import pytest

from vpipe_lab.core.settings import Settings
from vpipe_lab.core.settings_flags import Offered, add_flags, byte_size, from_args


def parser(door: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x")
    add_flags(p, door)
    return p


def test_flags_are_the_fields_names_with_their_kinds() -> None:
    args = parser("run").parse_args(["-k", "3", "--microbatches", "8", "--budget", "1GiB", "--no-telemetry",
                                     "--no-fused-wgrad", "--auto-replan", "--clip-grad-norm", "0.5"])
    got = from_args(args, "run")
    assert (got.stages, got.microbatches, got.memory_budget, got.telemetry, got.fused_wgrad, got.auto_replan,
            got.clip_grad_norm) == (3, 8, 1 << 30, False, False, True, 0.5)
    assert from_args(parser("run").parse_args(["--fused-wgrad", "0"]), "run").fused_wgrad == 0
    assert from_args(parser("run").parse_args([]), "run") == Settings()


def test_a_torchrun_worker_has_its_own_flags_and_defaults() -> None:
    p = parser("worker")
    options = {o for a in p._actions for o in a.option_strings}
    assert {"--virtual-stages", "--run-dir", "--save-every", "--iterations"} <= options
    assert not {"--stages", "--max-restarts", "--host"} & options  # torchrun gives those
    assert from_args(p.parse_args([]), "worker", stages=4) == Settings(stages=4, timeout=300.0)


def test_choices_are_listed_but_the_settings_refuse_a_wrong_one() -> None:
    p = parser("magics")
    assert "{auto,cpu,cuda}" in p.format_help() and "zbv" in p.format_help()
    assert from_args(p.parse_args(["--device", "tpu"]), "magics").device == "tpu"  # refused by validated()
    assert "zbv" in Offered(("zbv",)) and "other" in Offered(("zbv",)) and list(Offered(("a", "b"))) == ["a", "b"]


def test_a_size_reads_like_a_human_writes_it() -> None:
    assert byte_size("512MiB") == 512 << 20 and byte_size("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError, match="lots"):
        byte_size("lots")
    with pytest.raises(SystemExit):
        parser("run").parse_args(["--memory-budget", "lots"])
