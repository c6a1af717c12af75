"""Every field of ``Settings`` reaches every door it says it does (``launch()``, ``%vpipe start``, ``vpipe-lab run``,
``vpipe-lab worker``): the same flag, parsed to the same value, refused with the same words, before anything starts.
A field added without a door, a door that loses a flag, or a check said differently somewhere fails here."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.testing import globalipapp

from vpipe_lab.cli.main import build_parser as cli_parser
from vpipe_lab.cli.main import main
from vpipe_lab.control.launch import job_settings, launch
from vpipe_lab.core.settings import DOORS, Settings, door_fields, meta_of
from vpipe_lab.core.settings_flags import flag, from_args
from vpipe_lab.jupyter.magics import build_parser as magics_parser
from vpipe_lab.jupyter.magics import subcommands

# field -> (flag words giving a good value, that value, flag words of a bad one or None, settings it needs beside it)
CASES: dict[str, tuple[list[str], Any, list[str] | None, dict[str, Any]]] = {
    "stages": (["3"], 3, ["0"], {}),
    "microbatches": (["8"], 8, ["0"], {}),
    "schedule": (["zbv"], "zbv", ["zigzag"], {}),
    "virtual_stages": (["2"], 2, ["0"], {"schedule": "interleaved-1f1b"}),
    "replicas": (["2"], 2, ["0"], {}),
    "shards": (["2"], 2, ["0"], {}),
    "device": (["cpu"], "cpu", ["tpu"], {}),
    "engine": (["torch"], "torch", ["jax"], {}),
    "seed": (["7"], 7, None, {}),
    "memory_budget": (["2GiB"], 2 << 30, ["0"], {}),
    "precision": (["bf16"], "bf16", ["fp8"], {}),
    "clip_grad_norm": (["1.5"], 1.5, ["0"], {}),
    "nonfinite": (["skip"], "skip", ["nan"], {}),
    "fused_wgrad": (["0"], 0, ["-1"], {}),
    "eval_every": (["5"], 5, ["0"], {}),
    "eval_batches": (["2"], 2, ["0"], {}),
    "log": (["tensorboard:runs"], "tensorboard:runs", ["carrier-pigeon:coop"], {}),
    "telemetry": ([], False, None, {}),  # a switch: --no-telemetry
    "timeout": (["30"], 30.0, ["0"], {}),
    "start_timeout": (["30"], 30.0, ["0"], {}),
    "threads": (["2"], 2, ["0"], {}),
    "host": (["0.0.0.0"], "0.0.0.0", [""], {}),
    "auto_replan": ([], True, None, {}),  # a switch: --auto-replan
    "max_restarts": (["2"], 2, ["-1"], {}),
    "snapshot_every": (["3"], 3, ["-1"], {"max_restarts": 1, "run_dir": "run"}),
    "iterations": (["10"], 10, ["0"], {}),
    "save_every": (["4"], 4, ["0"], {"run_dir": "run"}),
    "run_dir": (["run"], "run", [""], {}),
}


@pytest.fixture(scope="module")
def ip():  # type: ignore[no-untyped-def]
    shell = globalipapp.start_ipython() or globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "vpipe_lab")
    yield shell
    shell.run_line_magic("vpipe", "stop")


def parsers() -> dict[str, tuple[argparse.ArgumentParser, list[str]]]:
    """Each command-line door's parser and the words before its settings."""
    cli = cli_parser()
    run, worker = (a.choices[n] for a in cli._actions if isinstance(a, argparse._SubParsersAction) for n in ("run",
                                                                                                             "worker"))
    return {"magics": (subcommands(magics_parser())["start"], ["mlp"]), "run": (run, []),
            "worker": (worker, ["--model", "mlp"])}


def words(name: str, given: list[str]) -> list[str]:
    f = next(f for f in fields(Settings) if f.name == name)
    if str(f.type).startswith("bool") and not given:  # a switch
        return [f"--no-{name.replace('_', '-')}"] if f.default else [flag(name)]
    return [flag(name), *given]


def test_every_field_has_a_case_help_and_a_way_in_at_every_door() -> None:
    assert set(CASES) == {f.name for f in fields(Settings)}, "give a new setting its case here, and its doors"
    for f in fields(Settings):
        meta = meta_of(f)
        assert meta.help and meta.check is not None, f.name
        for door in DOORS:
            assert door in meta.away or f in door_fields(door), (f.name, door)
            assert meta.away.get(door, "x"), (f.name, door)  # an away door says where the setting comes from


@pytest.mark.parametrize("door", ["magics", "run", "worker"])
def test_each_command_line_door_parses_each_of_its_fields_to_the_value_the_api_takes(door: str) -> None:
    parser, before = parsers()[door]
    for f in door_fields(door):
        given, value, _, _ = CASES[f.name]
        args = parser.parse_args([*before, *words(f.name, given)])
        assert getattr(from_args(args, door), f.name) == value, (door, f.name)
        action = next(a for a in parser._actions if a.dest == f.name)
        assert meta_of(f).help[1:20] in (action.help or ""), (door, f.name)  # the help is the field's own
    defaults = from_args(parser.parse_args(before), door)
    assert defaults == Settings.of(door, **{}), door  # a door's defaults are the settings' (with its own overrides)


def test_the_api_takes_each_of_its_fields_and_nothing_else() -> None:
    for f in door_fields("api"):
        _, value, _, beside = CASES[f.name]
        extra = {k: v for k, v in beside.items() if k in {g.name for g in door_fields("api")}}
        if f.name == "engine":
            extra["schedule"] = "1f1b"
        assert getattr(job_settings(None, {f.name: value, **extra}, None), f.name) == (
            value if f.name != "memory_budget" else (value, value)), f.name
    with pytest.raises(TypeError, match="unknown setting 'microbatch': did you mean 'microbatches'"):
        job_settings(None, {"microbatch": 4}, None)
    with pytest.raises(TypeError, match="run_dir is not set here: a launched session trains when told"):
        job_settings(None, {"run_dir": "r"}, None)


def test_a_bad_value_is_refused_with_the_same_words_at_every_door_before_anything_starts(
        ip, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: a worker checks its settings before the rendezvous
    doors = parsers()
    for name, (_, _, bad, _) in CASES.items():
        if bad is None:
            continue
        said: dict[str, str] = {}
        for door in DOORS:
            if door not in (d for d in DOORS if any(f.name == name for f in door_fields(d))):
                continue
            if door == "api":
                parser, before = next(doors[d] for d in ("run", "worker") if d in doors and any(
                    f.name == name for f in door_fields(d)))
                value = getattr(parser.parse_args([*before, *words(name, bad)]), name)
                with pytest.raises(ValueError) as err:
                    launch("mlp", **{name: value})
                said[door] = str(err.value)
            elif door == "magics":
                ip.user_ns.pop("session", None)
                with pytest.raises(UsageError) as usage:
                    ip.run_line_magic("vpipe", " ".join(["start", "mlp", *words(name, bad)]) if bad != [""] else
                                      f"start mlp {flag(name)} ''")
                said[door] = str(usage.value)
                assert "session" not in ip.user_ns
            else:
                line = ["run"] if door == "run" else ["worker", "--model", "mlp"]
                assert main([*line, *words(name, bad)]) == 2, (door, name)
                said[door] = capsys.readouterr().err.strip().removeprefix("vpipe-lab: error: ")
        assert len(set(said.values())) == 1 and name in next(iter(said.values())), (name, said)
